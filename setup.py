"""Build script of torch_kvswap.

Always builds ``torch_kvswap._C``: the schemas, the core (validation and
descriptor building) and the host engine. The accelerator engines are separate
extensions, detected at build time without needing the hardware:

* ``torch_kvswap._C_cuda`` (``csrc/cuda/``): built when torch is a CUDA build and
  a CUDA toolkit is found. ``KVSWAP_BUILD_CUDA=1`` forces it, ``=0`` skips it.
* ``torch_kvswap._C_npu`` (``csrc/ascend/``): built when torch_npu is installed
  (its headers are all the build reads; CANN is found at run time).
  ``KVSWAP_BUILD_NPU=1`` forces it, ``=0`` skips it.
* ``torch_kvswap._fake_cuda`` (tests only, ``tests/fake_cuda/``): the CUDA
  engine's host logic bound to a fake CUDA runtime on host memory, so the
  CPU suite runs it. Built when ``KVSWAP_BUILD_FAKES=1`` (scripts/env.sh sets
  it) and the CUDA runtime headers are found (``CUDA_HOME``, or nvcc's
  toolkit, or ``/usr/local/cuda``); it needs no GPU and no CUDA build of torch.

Build with ``pip install --no-build-isolation .`` so the extension is compiled
against the torch already installed.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"

# Warnings that point to real bugs in copy code (narrowing, sign mix-ups,
# ignored return values) fail the build instead of scrolling past.
STRICT_CXX = [
    "-O3",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Werror=return-type",
    "-Werror=unused-result",
    "-Werror=sign-compare",
    "-Werror=narrowing",
    "-Werror=uninitialized",
    "-Wno-unused-parameter",
]


def _flag(name: str) -> bool | None:
    """Tri-state environment switch: True, False, or None for 'detect'."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def _rel(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _torch_parallel_backend_is_openmp() -> bool:
    """True when torch's at::parallel_for is OpenMP (ATen/Config.h says so)."""
    from torch.utils.cpp_extension import include_paths

    for inc in include_paths():
        config = Path(inc) / "ATen" / "Config.h"
        if config.is_file():
            return "#define AT_PARALLEL_OPENMP 1" in config.read_text()
    return False


def core_extension() -> CppExtension:
    sources = [CSRC / "registration.cpp", *sorted((CSRC / "core").glob("*.cpp")),
               CSRC / "host" / "host_engine.cpp"]
    # The host engine runs on at::parallel_for, which is inline OpenMP code
    # when torch's backend is OpenMP. Linking -fopenmp adds a libgomp.so.1
    # dependency that resolves to the copy torch already loaded, so the
    # process keeps one OpenMP runtime and one set of threads.
    openmp = ["-fopenmp"] if _torch_parallel_backend_is_openmp() else []
    return CppExtension(
        "torch_kvswap._C",
        _rel(sources),
        extra_compile_args={"cxx": STRICT_CXX + openmp},
        extra_link_args=openmp,
        py_limited_api=False,
    )


def _cuda_include_dir() -> str | None:
    """The CUDA toolkit's include directory with cuda_runtime_api.h, if any."""
    from torch.utils.cpp_extension import CUDA_HOME

    for home in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return str(Path(home) / "include")
    return None


def cuda_extension():
    wanted = _flag("KVSWAP_BUILD_CUDA")
    if wanted is False:
        return None
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    found = bool(torch.version.cuda) and CUDA_HOME is not None
    if not (found or wanted):
        return None
    # Host logic (cuda_engine.cpp), its binding to libcudart and torch
    # (cuda_api_real.cpp), and the kernel (copy_kernel.cu, nvcc).
    sources = [CSRC / "cuda" / "cuda_engine.cpp", CSRC / "cuda" / "cuda_api_real.cpp",
               CSRC / "cuda" / "copy_kernel.cu"]
    return CUDAExtension(
        "torch_kvswap._C_cuda",
        _rel(sources),
        extra_compile_args={"cxx": STRICT_CXX, "nvcc": ["-O3", "-Xcompiler", "-fvisibility=hidden"]},
    )


def fake_cuda_extension():
    """The CUDA engine's host logic against the fake runtime (tests only)."""
    if not _flag("KVSWAP_BUILD_FAKES"):
        return None
    include = _cuda_include_dir()
    if include is None:
        print("warning: KVSWAP_BUILD_FAKES=1 but no CUDA runtime headers were found; "
              "torch_kvswap._fake_cuda is not built and its tests skip", file=sys.stderr)
        return None
    fakes = ROOT / "tests" / "fake_cuda"
    sources = [fakes / "engine_under_test.cpp", fakes / "fake_cuda_runtime.cpp",
               fakes / "fake_cuda_module.cpp"]
    coverage = ["--coverage"] if _flag("KVSWAP_FAKE_COVERAGE") else []
    return CppExtension(
        "torch_kvswap._fake_cuda",
        _rel(sources),
        include_dirs=[include],
        extra_compile_args={"cxx": [f for f in STRICT_CXX if f != "-O3"] + ["-O2"] + coverage},
        extra_link_args=coverage,
    )


def _torch_npu_root() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def npu_extension():
    """The Ascend engine. It links neither CANN nor torch_npu: ACL functions are
    looked up at run time in the library torch_npu loads, so one build serves
    every CANN release. torch_npu's bundled ACL headers are only read, to check
    the engine's mirrors of ACL's types (csrc/ascend/acl_real.cpp)."""
    wanted = _flag("KVSWAP_BUILD_NPU")
    if wanted is False:
        return None
    npu_root = _torch_npu_root()
    if npu_root is None:
        if wanted:
            raise RuntimeError("KVSWAP_BUILD_NPU=1 but torch_npu is not installed")
        return None
    sources = sorted((CSRC / "ascend").glob("*.cpp"))
    return CppExtension(
        "torch_kvswap._C_npu",
        _rel(sources),
        include_dirs=[str(npu_root / "include")],
        libraries=["dl"],
        extra_compile_args={"cxx": STRICT_CXX},
    )


def extensions():
    exts = [core_extension()]
    for make in (cuda_extension, npu_extension, fake_cuda_extension):
        ext = make()
        if ext is not None:
            exts.append(ext)
    return exts


if shutil.which("ninja") is None:
    print("warning: ninja not found; the build falls back to a slow serial compile", file=sys.stderr)

setup(
    name="torch_kvswap",
    version="0.1.0",
    description="Batched KV-cache block copies between accelerator and host memory for PyTorch",
    packages=find_packages(include=["torch_kvswap", "torch_kvswap.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy"],
    extras_require={"plot": ["matplotlib"], "test": ["pytest", "hypothesis", "expecttest"]},
)
