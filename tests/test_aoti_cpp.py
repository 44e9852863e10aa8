"""Deployment without Python: a C++ program linked against libtorch opens
torch_kvswap's library with dlopen, loads an AOTInductor package whose graph
calls ``kvswap::swap_blocks``, runs it, and checks the bytes
(tests/aoti/run_package.cpp). And ``torch.ops.load_library`` of a library,
in a process that never imports the package, gets its ops and its engine.

Both hold because registration happens when a library loads: the core's
ops and host engine (``TORCH_LIBRARY``, csrc/core/engines.cpp), and each
engine, which links the core and installs itself in its registry
(csrc/kvswap.h, ``install_engine``; csrc/python_module.h).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_kvswap  # noqa: F401 - the kvswap ops, to export the graph
from torch_kvswap import _loader

ROOT = Path(__file__).resolve().parents[1]
RUNNER_SOURCE = ROOT / "tests" / "aoti" / "run_package.cpp"
BLOCKS, ELEMS = 8, 16
SRC_IDS, DST_IDS = [1, 3, 6], [0, 5, 2]


class SwapInto(torch.nn.Module):
    """The graph the package holds: one swap_blocks call, nothing else."""

    def forward(self, src_k, src_v, dst_k, dst_v, src_ids, dst_ids):
        torch.ops.kvswap.swap_blocks([src_k, src_v], [dst_k, dst_v], src_ids, dst_ids)


def library(module: str) -> Path:
    """The shared library of an extension module of the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not built")
    return Path(spec.origin)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    cache = torch.zeros(BLOCKS, ELEMS)
    args = (cache, cache.clone(), cache.clone(), cache.clone(), torch.tensor(SRC_IDS), torch.tensor(DST_IDS))
    exported = torch.export.export(SwapInto(), args)
    path = tmp_path_factory.mktemp("aoti") / "swap_into.pt2"
    return Path(torch._inductor.aoti_compile_and_package(exported, package_path=str(path)))


@pytest.fixture(scope="module")
def runner() -> Path:
    """tests/aoti/run_package.cpp, compiled against this torch (kept in
    build/aoti/, keyed by torch release and compile command; rebuilt when
    the source is newer)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    (lib,) = library_paths()[:1]
    flags = [
        "-std=c++20",
        "-O1",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in include_paths()),
        str(RUNNER_SOURCE),
        f"-L{lib}",
        # Loaded even though nothing here names them: torch 2.15's package
        # loader opens libtorch.so by name, found only when already loaded.
        "-Wl,--no-as-needed",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
        "-Wl,--as-needed",
        "-ldl",
        f"-Wl,-rpath,{lib}",
    ]
    key = hashlib.sha256("\0".join(flags).encode()).hexdigest()[:12]
    out = ROOT / "build" / "aoti" / f"{torch.__version__}-{key}" / "run_package"
    if out.is_file() and out.stat().st_mtime > RUNNER_SOURCE.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    built = subprocess.run(["g++", *flags, "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def run(runner: Path, package: Path, mode: str, *libraries: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(runner), str(package), mode, *map(str, libraries)], capture_output=True, text=True, timeout=300
    )


def test_a_cpp_program_runs_the_package_on_the_host_engine(runner, package):
    done = run(runner, package, "cpu", library("torch_kvswap._C"))
    assert done.returncode == 0, done.stderr[-4000:]
    # three blocks of K and of V, 16 floats each; no accelerator runtime
    assert done.stdout.split() == ["ok", "cpu", str(2 * 3 * ELEMS * 4), "0"]


def test_the_programs_check_fails_when_the_reference_differs(runner, package):
    done = run(runner, package, "cpu-control", library("torch_kvswap._C"))
    assert (done.returncode, done.stdout.strip()) == (1, "mismatch cpu-control pair 0 block 2")


def test_without_the_library_the_package_cannot_find_the_op(runner, package):
    done = run(runner, package, "cpu")
    assert done.returncode == 2
    assert "Could not find schema for kvswap::swap_blocks" in done.stderr


def test_a_cpp_program_runs_the_package_on_the_fake_cuda_runtime(runner, package):
    """The test extension links the core, so opening it alone brings the ops;
    its CUDA engine (csrc/cuda/cuda_engine.cpp on the fake runtime) copies
    into fake device memory on the current stream, read after a sync."""
    done = run(runner, package, "fake_cuda", library("torch_kvswap._fake_cuda"))
    assert done.returncode == 0, done.stderr[-4000:]
    ok, mode, copied, calls = done.stdout.split()
    assert (ok, mode, int(copied)) == ("ok", "fake_cuda", 2 * 3 * ELEMS * 4)
    assert int(calls) > 0, "the fake runtime saw no call: the copy did not go through the CUDA engine"


LOAD_LIBRARY = """
import json, sys, torch
for path in sys.argv[1:]:
    torch.ops.load_library(path)
print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith("torch_kvswap")),
                  "engines": sorted(torch.ops.kvswap._engines())}))
"""


def load_library(*paths: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOAD_LIBRARY, *map(str, paths)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_load_library_of_the_core_serves_the_host():
    assert load_library(library("torch_kvswap._C")) == {"modules": [], "engines": ["cpu"]}


@pytest.mark.parametrize("engine", ["cuda", "npu"])
def test_load_library_of_each_built_engine_installs_it(engine):
    """Each engine this build made installs itself as its library loads; the
    core comes with it (the engine links it)."""
    info = _loader.build_info() or {}
    entry = info.get("engines", {}).get(engine, {})
    if not entry.get("built"):
        pytest.skip(f"the {engine} engine is not built here: {entry.get('reason', 'no build record')}")
    if engine == "npu":
        pytest.skip("loading the Ascend engine by path needs torch_npu imported first (docs/ascend.md)")
    got = load_library(library(entry["module"]))
    assert got == {"modules": [], "engines": sorted(["cpu", engine])}


def test_importing_the_package_after_load_library_copies_with_the_loaded_library():
    """The import finds the library already loaded (once: a second load
    would register the namespace twice) and copies through it."""
    script = (
        "import sys, torch; torch.ops.load_library(sys.argv[1]); import torch_kvswap; "
        "src = torch.arange(32.).view(4, 8); dst = torch.zeros(4, 8); "
        "torch_kvswap.ops.swap_blocks([src], [dst], torch.tensor([2, 0]), torch.tensor([1, 3])); "
        "print(dst[1].equal(src[2]), dst[3].equal(src[0]), int(dst[0].abs().sum() + dst[2].abs().sum()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(library("torch_kvswap._C"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["True", "True", "0"]
