"""Build script of torch_kvswap.

Install into the environment that holds the torch you run, without build
isolation, so the extensions are compiled against that torch:

    pip install --no-build-isolation .

Always builds ``torch_kvswap._C``: the schemas, the core (validation and
descriptor building) and the host engine. The accelerator engines are separate
extensions, detected at build time without needing the hardware:

* ``torch_kvswap._C_cuda`` (``csrc/cuda/``): built when torch is a CUDA build and
  a CUDA toolkit of the same major version is found. With no visible GPU it is
  compiled for ``DEFAULT_CUDA_ARCHS`` (``setup_helpers/engines.py``;
  ``TORCH_CUDA_ARCH_LIST`` overrides).
  ``KVSWAP_BUILD_CUDA=1`` forces it (a failure is then an error), ``=0`` skips it.
* ``torch_kvswap._C_npu`` (``csrc/ascend/``): built when torch_npu is installed
  (its headers are all the build reads; CANN is found at run time).
  ``KVSWAP_BUILD_NPU=1`` forces it, ``=0`` skips it.
* ``torch_kvswap._fake_cuda`` (tests only, ``tests/fake_cuda/``): the CUDA
  engine's host logic bound to a fake CUDA runtime on host memory. Built only
  in place (``setup.py build_ext --inplace``, as ``scripts/env.sh`` does) with
  ``KVSWAP_BUILD_FAKES=1``; never into a wheel.

An engine that was detected but fails to compile is left out with its reason
(the host engine and forced engines fail the build instead). A build starts
by printing what it will compile (each engine, the CUDA architectures, a rough
duration), prints a line as each extension starts and ends with its elapsed
time, and ends with one line per engine: built, or not built with the reason
and how to enable it; an in-place rebuild with nothing newer than the built
files prints one line instead. The same facts, with each built extension's
file name, are written to ``torch_kvswap/_build_info.json``, which ``python -m
torch_kvswap`` reports and the import checks against the running torch. pip
shows the build's output only with ``-v`` (``pip install -v
--no-build-isolation .``). A build that is not in place (a wheel, ``pip
install``) holds only the extension files it wrote itself. Compiler command
lines are shown only when a build fails, or with ``KVSWAP_VERBOSE_BUILD=1``.

The metadata is in pyproject.toml (``[project]``). This file says what each
extension compiles; which engines to build and the build command are in
``setup_helpers/`` (not shipped).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
# pip runs this file without its folder on the path.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from setup_helpers import INSTALL_COMMAND, PREREQUISITES, flag, release  # noqa: E402
from setup_helpers.engines import (  # noqa: E402
    Decision,
    Engine,
    decide_cuda,
    decide_fakes,
    decide_npu,
    gather_facts,
    refuse_impossible_forced,
)

#: The oldest torch release the package builds against and is tested with
#: (README.md, "Install"): vllm-ascend's pin (torch 2.10.0 with torch-npu
#: 2.10.0), the oldest of the releases its users run. pyproject.toml's
#: dependencies say the same (tests/test_install.py checks that they agree).
MIN_TORCH = (2, 10)

ISOLATION_MESSAGE = f"""
torch_kvswap compiles against the torch it will be imported with, and no torch
is importable in this build environment: pip's build isolation hides the torch
you have installed (and building against another one would give extensions your
torch cannot load). Install torch first, then build without isolation:

    {INSTALL_COMMAND}

(from the repository root; ninja and a C++ compiler are needed).
"""

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


def import_build_torch():
    """The torch to compile against, or a SystemExit that says how to install."""
    try:
        import torch
    except ImportError:
        raise SystemExit(ISOLATION_MESSAGE) from None
    # pip's isolated build environments live in pip-build-env-* folders: a
    # torch found there is not the one that will import the extensions.
    if "pip-build-env" in str(Path(torch.__file__).resolve()):
        raise SystemExit(ISOLATION_MESSAGE)
    if release(torch.__version__)[:2] < MIN_TORCH:
        raise SystemExit(
            f"torch_kvswap needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
            f"this environment has torch {torch.__version__}."
        )
    return torch


def require_wheel_support() -> None:
    """pip builds through setuptools' bdist_wheel, which setuptools has only
    from 70.1 on; older ones need the `wheel` package (a fresh Python 3.11
    venv has setuptools 65 and no wheel)."""
    import setuptools

    if release(setuptools.__version__) < (70, 1) and importlib.util.find_spec("wheel") is None:
        raise SystemExit(
            f"setuptools {setuptools.__version__} cannot build wheels without the `wheel` "
            f"package: {PREREQUISITES}, then {INSTALL_COMMAND}"
        )


# ---------------------------------------------------------------- extensions


def _rel(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _headers(*folders: Path) -> list[str]:
    """The headers of these folders, as an extension's ``depends``: an
    in-place rebuild skips an extension whose file is newer than its sources
    and these (setup_helpers/build_command.py, ``BuildWithSummary.stale``)."""
    return _rel(sorted(h for folder in folders for h in folder.glob("*.h")))


def _torch_parallel_backend_is_openmp() -> bool:
    """True when torch's at::parallel_for is OpenMP (ATen/Config.h says so)."""
    from torch.utils.cpp_extension import include_paths

    for inc in include_paths():
        config = Path(inc) / "ATen" / "Config.h"
        if config.is_file():
            return "#define AT_PARALLEL_OPENMP 1" in config.read_text()
    return False


def core_extension():
    from torch.utils.cpp_extension import CppExtension

    sources = [
        CSRC / "registration.cpp",
        *sorted((CSRC / "core").glob("*.cpp")),
        CSRC / "host" / "host_engine.cpp",
    ]
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
        depends=_headers(CSRC, CSRC / "core", CSRC / "host"),
    )


def cuda_extension(decision: Decision):
    from torch.utils.cpp_extension import CUDAExtension

    # Host logic (cuda_engine.cpp), its binding to libcudart and torch
    # (cuda_api_real.cpp), and the kernel (copy_kernel.cu, nvcc).
    sources = [
        CSRC / "cuda" / "cuda_engine.cpp",
        CSRC / "cuda" / "cuda_api_real.cpp",
        CSRC / "cuda" / "copy_kernel.cu",
    ]
    return CUDAExtension(
        "torch_kvswap._C_cuda",
        _rel(sources),
        optional=not decision.forced,
        depends=_headers(CSRC, CSRC / "cuda"),
        extra_compile_args={"cxx": STRICT_CXX, "nvcc": ["-O3", "-Xcompiler", "-fvisibility=hidden"]},
    )


def npu_extension(decision: Decision, npu_root: Path):
    """The Ascend engine. It links no CANN library: ACL functions are looked up
    at run time in the library torch_npu loads, so one build serves every CANN
    release. torch_npu's bundled ACL headers are only read, to check the
    engine's mirrors of ACL's types (csrc/ascend/acl_real.cpp); torch-npu
    2.10.0.post4 ships them only under include/third_party/acl/inc.

    libtorch_npu is linked only if referenced (--as-needed): under torch_npu
    2.13 and later the engine reaches its stream handle through torch's device
    guard and references nothing of it; before 2.13 it calls torch_npu's
    NPUStream::stream() (acl_real.cpp, acl_stream_of). The library is already
    loaded then: the loader imports torch_npu before the engine."""
    from torch.utils.cpp_extension import CppExtension

    include = npu_root / "include"
    link_torch_npu = ["-Wl,--as-needed", f"-L{npu_root / 'lib'}", "-ltorch_npu", "-Wl,--no-as-needed"]
    return CppExtension(
        "torch_kvswap._C_npu",
        _rel(sorted((CSRC / "ascend").glob("*.cpp"))),
        include_dirs=[str(include), str(include / "third_party" / "acl" / "inc")],
        libraries=["dl"],
        optional=not decision.forced,
        depends=_headers(CSRC, CSRC / "ascend"),
        extra_compile_args={"cxx": STRICT_CXX},
        extra_link_args=link_torch_npu,
    )


def fake_cuda_extension(include: str):
    """The test extension (tests only): the CUDA engine's host logic against
    the fake runtime, a recording engine and calls into engines (kvswap_test)."""
    from torch.utils.cpp_extension import CppExtension

    fakes = ROOT / "tests" / "fake_cuda"
    sources = [
        fakes / "engine_under_test.cpp",
        fakes / "fake_cuda_runtime.cpp",
        fakes / "fake_cuda_module.cpp",
        fakes / "test_extension.cpp",
    ]
    coverage = ["--coverage"] if flag("KVSWAP_FAKE_COVERAGE") else []
    # engine_under_test.cpp includes csrc/cuda/cuda_engine.cpp; test_extension.cpp
    # the core's test hooks.
    depends = _headers(CSRC, CSRC / "cuda", fakes) + _rel(
        [CSRC / "cuda" / "cuda_engine.cpp", CSRC / "core" / "test_hooks.h"]
    )
    return CppExtension(
        "torch_kvswap._fake_cuda",
        _rel(sources),
        include_dirs=[include],
        depends=depends,
        extra_compile_args={"cxx": [f for f in STRICT_CXX if f != "-O3"] + ["-O2"] + coverage},
        extra_link_args=coverage,
    )


def plan_engines(torch) -> list[Engine]:
    facts = gather_facts(torch)
    cuda, npu, fakes = decide_cuda(facts), decide_npu(facts), decide_fakes(facts)
    refuse_impossible_forced(cuda, npu)
    if cuda.build and cuda.arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda.arch_list
    return [
        Engine("host", "torch_kvswap._C", Decision(True, forced=True), core_extension()),
        Engine("cuda", "torch_kvswap._C_cuda", cuda, cuda_extension(cuda) if cuda.build else None),
        Engine(
            "npu", "torch_kvswap._C_npu", npu, npu_extension(npu, facts.torch_npu_root) if npu.build else None
        ),
        Engine(
            "fake_cuda",
            "torch_kvswap._fake_cuda",
            fakes,
            fake_cuda_extension(facts.cuda_headers) if fakes.build else None,
            test_only=True,
        ),
    ]


def main() -> None:
    torch = import_build_torch()
    require_wheel_support()
    if shutil.which("ninja") is None:
        print("warning: ninja not found; the build falls back to a slow serial compile", file=sys.stderr)
    engines = plan_engines(torch)
    # Imports torch's extension builder: only after the checks above.
    from setup_helpers.build_command import BuildWithSummary

    BuildWithSummary.engines = engines
    setup(
        packages=find_packages(include=["torch_kvswap", "torch_kvswap.*"]),
        ext_modules=[e.extension for e in engines if e.extension is not None],
        cmdclass={"build_ext": BuildWithSummary},
    )


if __name__ == "__main__":
    main()
