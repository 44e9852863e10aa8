"""Builds and loads the fake-ACL test extension: the Ascend engine's own source
(csrc/ascend/ascend_engine.cpp) bound to a fake ACL runtime, plus a fake
PrivateUse1 backend renamed to ``npu``.

Loading it makes ``npu`` torch's accelerator for the rest of the process, so
only the child pytest of tests/test_ascend_fake.py loads it.

Environment:
  KVSWAP_FAKE_NPU_BUILD_DIR   build directory (default: build/fake_npu)
  KVSWAP_FAKE_NPU_CFLAGS      extra compiler flags (scripts/coverage_ascend.sh
                              passes --coverage)
  KVSWAP_FAKE_NPU_LDFLAGS     extra linker flags
  KVSWAP_FAKE_ACL_ABSENT      comma-separated ACL functions missing from the
                              engine's first table, e.g.
                              aclrtMemcpyBatchAsync,aclmdlRICaptureGetInfo
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENGINE_SOURCES = [ROOT / "csrc" / "ascend" / "ascend_engine.cpp"]
FAKE_SOURCES = [HERE / "fake_acl.cpp", HERE / "fake_backend.cpp"]

_ext = None


def _device_module(ext):
    """The ``torch.npu`` module torch.accelerator asks for device counts."""
    import types

    mod = types.ModuleType("torch.npu")
    mod.is_available = lambda: True
    mod.device_count = lambda: 2
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.current_device = lambda: torch.accelerator.current_device_index()
    mod.set_device = lambda d: torch.accelerator.set_device_index(d)
    mod.synchronize = lambda d=None: torch.accelerator.synchronize(d)
    mod.ext = ext
    return mod


def load_fake():
    """The loaded extension (built on first use; ninja makes a warm rebuild a no-op)."""
    global _ext
    if _ext is not None:
        return _ext
    import torch_kvswap._C  # the kvswap schemas must exist before the engine registers

    core = Path(torch_kvswap._C.__file__)

    build_dir = Path(os.environ.get("KVSWAP_FAKE_NPU_BUILD_DIR", ROOT / "build" / "fake_npu"))
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = ["-O1", "-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    cflags += os.environ.get("KVSWAP_FAKE_NPU_CFLAGS", "").split()
    _ext = load(
        name="kvswap_fake_npu",
        sources=[str(p) for p in ENGINE_SOURCES + FAKE_SOURCES],
        extra_include_paths=[str(ROOT / "csrc"), str(HERE)],
        extra_cflags=cflags,
        # The engine installs itself in the core's registry, which it links
        # as the engine's library does (setup_helpers/build_command.py, link_core).
        extra_ldflags=[f"-L{core.parent}", f"-l:{core.name}", f"-Wl,-rpath,{core.parent}"]
        + os.environ.get("KVSWAP_FAKE_NPU_LDFLAGS", "").split(),
        build_directory=str(build_dir),
        verbose=False,
    )
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", _device_module(_ext))
    absent = [n for n in os.environ.get("KVSWAP_FAKE_ACL_ABSENT", "").split(",") if n]
    if absent:
        _ext.set_absent(absent)
    return _ext
