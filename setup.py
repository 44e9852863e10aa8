"""Build script of torch_kvswap.

Install into the environment that holds the torch you run, without build
isolation, so the extensions are compiled against that torch:

    pip install --no-build-isolation .

Always builds ``torch_kvswap._C``: the schemas, the core (validation and
descriptor building) and the host engine. The accelerator engines are separate
extensions, detected at build time without needing the hardware:

* ``torch_kvswap._C_cuda`` (``csrc/cuda/``): built when torch is a CUDA build and
  a CUDA toolkit of the same major version is found. With no visible GPU it is
  compiled for :data:`DEFAULT_CUDA_ARCHS` (``TORCH_CUDA_ARCH_LIST`` overrides).
  ``KVSWAP_BUILD_CUDA=1`` forces it (a failure is then an error), ``=0`` skips it.
* ``torch_kvswap._C_npu`` (``csrc/ascend/``): built when torch_npu is installed
  (its headers are all the build reads; CANN is found at run time).
  ``KVSWAP_BUILD_NPU=1`` forces it, ``=0`` skips it.
* ``torch_kvswap._fake_cuda`` (tests only, ``tests/fake_cuda/``): the CUDA
  engine's host logic bound to a fake CUDA runtime on host memory. Built only
  in place (``setup.py build_ext --inplace``, as ``scripts/env.sh`` does) with
  ``KVSWAP_BUILD_FAKES=1``; never into a wheel.

An engine that was detected but fails to compile is left out with its reason
(the host engine and forced engines fail the build instead). Every build starts
by printing what it will compile (each engine, the CUDA architectures, a rough
duration) and ends with one line per engine: built, or not built with the
reason and how to enable it; the same facts, with each built extension's file
name, are written to ``torch_kvswap/_build_info.json``, which ``python -m
torch_kvswap`` reports and the import checks against the running torch. pip
shows both only with ``-v``. A build that is not in place (a wheel, ``pip
install``) holds only the extension files it wrote itself. Compiler command
lines are shown only when a build fails, or with ``KVSWAP_VERBOSE_BUILD=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _load_build_shared():
    """torch_kvswap/_build_shared.py, by its path: importing the package would
    load its compiled extensions, which this script is about to build."""
    spec = importlib.util.spec_from_file_location("torch_kvswap_build_shared",
                                                  ROOT / "torch_kvswap" / "_build_shared.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _load_build_shared()
INSTALL_COMMAND = _shared.INSTALL_COMMAND
release = _shared.release  # (major, minor, patch) of a version string such as '2.13.0+cpu'
summary_lines = _shared.summary_lines

#: The oldest torch release the package builds against and is tested with
#: (README.md, "Install"): vllm-ascend's pin (torch 2.10.0 with torch-npu
#: 2.10.0), the oldest of the releases its users run. pyproject.toml's
#: dependencies say the same (tests/test_install.py checks that they agree).
MIN_TORCH = (2, 10)

#: CUDA architectures compiled when no GPU is visible and
#: TORCH_CUDA_ARCH_LIST is unset: Ampere (8.0; also runs on 8.6/8.9), Hopper
#: (9.0), Blackwell data centre (10.0) and consumer (12.0), plus PTX for newer
#: GPUs. Architectures the installed nvcc cannot target are dropped.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"

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


def flag(name: str, env=os.environ) -> bool | None:
    """Tri-state environment switch: True, False, or None for 'detect'."""
    value = env.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


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
        raise SystemExit(f"torch_kvswap needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
                         f"this environment has torch {torch.__version__}.")
    return torch


@dataclass
class Facts:
    """What the engine decisions depend on, gathered once (tests fill it by hand)."""

    torch_version: str
    torch_cuda: str | None = None  # torch.version.cuda
    cuda_home: str | None = None
    nvcc_version: str | None = None  # "13.0"
    nvcc_archs: list[str] = field(default_factory=list)  # ["7.5", "8.0", ...]
    visible_gpus: int = 0
    torch_npu_root: Path | None = None
    cuda_headers: str | None = None  # include dir with cuda_runtime_api.h
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Decision:
    """Whether an engine is built; if not, why and how to enable it."""

    build: bool
    reason: str = ""
    enable: str = ""
    forced: bool = False
    arch_list: str | None = None  # CUDA only: TORCH_CUDA_ARCH_LIST to build with


def decide_cuda(f: Facts) -> Decision:
    wanted = flag("KVSWAP_BUILD_CUDA", f.env)
    if wanted is False:
        return Decision(False, "KVSWAP_BUILD_CUDA=0", "unset KVSWAP_BUILD_CUDA")
    forced = wanted is True
    if not f.torch_cuda and not forced:
        return Decision(False, f"torch {f.torch_version} is not a CUDA build",
                        "install a CUDA build of torch and a CUDA toolkit of the same major version")
    if f.cuda_home is None or f.nvcc_version is None:
        return Decision(False, "no CUDA toolkit found (nvcc with cuda_runtime_api.h beside it)",
                        "install the CUDA toolkit or set CUDA_HOME to it", forced)
    if f.torch_cuda and release(f.torch_cuda)[0] != release(f.nvcc_version)[0]:
        return Decision(False, f"nvcc {f.nvcc_version} and torch's CUDA {f.torch_cuda} differ in major "
                        "version, which torch's extension builder refuses",
                        f"install CUDA toolkit {release(f.torch_cuda)[0]}.x and set CUDA_HOME to it", forced)
    arch_list = f.env.get("TORCH_CUDA_ARCH_LIST") or None
    if arch_list is None and f.visible_gpus == 0:
        arch_list = default_cuda_archs(f.nvcc_archs)
        if not arch_list:
            return Decision(False, f"nvcc {f.nvcc_version} targets none of {DEFAULT_CUDA_ARCHS}",
                            "set TORCH_CUDA_ARCH_LIST", forced)
    return Decision(True, forced=forced, arch_list=arch_list)


def default_cuda_archs(supported: list[str]) -> str:
    """DEFAULT_CUDA_ARCHS less what nvcc cannot target; PTX on the newest kept."""
    wanted = [a.replace("+PTX", "") for a in DEFAULT_CUDA_ARCHS.split(";")]
    kept = [a for a in wanted if a in supported]
    if kept and DEFAULT_CUDA_ARCHS.endswith("+PTX"):
        kept[-1] += "+PTX"
    return ";".join(kept)


def decide_npu(f: Facts) -> Decision:
    wanted = flag("KVSWAP_BUILD_NPU", f.env)
    if wanted is False:
        return Decision(False, "KVSWAP_BUILD_NPU=0", "unset KVSWAP_BUILD_NPU")
    if f.torch_npu_root is None:
        return Decision(False, "torch_npu is not installed",
                        f"pip install torch-npu=={'.'.join(map(str, release(f.torch_version)))} "
                        "(torch_npu is all the build needs; CANN is found at run time)",
                        bool(wanted))
    return Decision(True, forced=bool(wanted))


FAKES_ENABLE = "KVSWAP_BUILD_FAKES=1 python setup.py build_ext --inplace (scripts/test.sh does)"


def decide_fakes(f: Facts) -> Decision:
    if not flag("KVSWAP_BUILD_FAKES", f.env):
        return Decision(False, "test-only", FAKES_ENABLE)
    if f.cuda_headers is None:
        return Decision(False, "no CUDA runtime headers found (CUDA_HOME, nvcc's toolkit, /usr/local/cuda)",
                        "install the CUDA toolkit's headers")
    return Decision(True)


# ---------------------------------------------------------------- facts


def _nvcc_facts(cuda_home: str | None) -> tuple[str | None, list[str]]:
    if cuda_home is None:
        return None, []
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
        archs = subprocess.run([str(nvcc), "--list-gpu-arch"], capture_output=True, text=True,
                               timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None, []
    match = re.search(r"release (\d+\.\d+)", out)
    return (match.group(1) if match else None), parse_gpu_archs(archs)


def parse_gpu_archs(listing: str) -> list[str]:
    """`nvcc --list-gpu-arch` output (compute_75, compute_100, ...) as
    TORCH_CUDA_ARCH_LIST entries (7.5, 10.0, ...)."""
    return [f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)\b", listing)]


def find_cuda_home(torch_guess: str | None, env=os.environ) -> str | None:
    """The CUDA toolkit to build with: the first of CUDA_HOME, CUDA_PATH,
    torch's guess and /usr/local/cuda that has the runtime headers. torch
    guesses from the nvcc on the path, and a wrapper script such as
    /usr/local/bin/nvcc makes that /usr/local, which has no CUDA headers."""
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), torch_guess, "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file() \
                and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home))
    return None


def _torch_npu_root() -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def gather_facts(torch) -> Facts:
    import torch.utils.cpp_extension as cpp_extension

    cuda_home = find_cuda_home(cpp_extension.CUDA_HOME)
    if cuda_home is not None and cuda_home != cpp_extension.CUDA_HOME:
        # torch's extension builder reads its module-level CUDA_HOME for the
        # include path, the library path and nvcc.
        cpp_extension.CUDA_HOME = cuda_home
        os.environ["CUDA_HOME"] = cuda_home
    nvcc_version, nvcc_archs = _nvcc_facts(cuda_home)
    try:
        visible = torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:  # noqa: BLE001 - a broken driver means no usable GPU
        visible = 0
    return Facts(torch_version=torch.__version__, torch_cuda=torch.version.cuda, cuda_home=cuda_home,
                 nvcc_version=nvcc_version, nvcc_archs=nvcc_archs, visible_gpus=visible,
                 torch_npu_root=_torch_npu_root(),
                 cuda_headers=str(Path(cuda_home) / "include") if cuda_home else None, env=dict(os.environ))


# ---------------------------------------------------------------- extensions


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


def core_extension():
    from torch.utils.cpp_extension import CppExtension

    sources = [CSRC / "registration.cpp", *sorted((CSRC / "core").glob("*.cpp")),
               CSRC / "host" / "host_engine.cpp"]
    # The host engine runs on at::parallel_for, which is inline OpenMP code
    # when torch's backend is OpenMP. Linking -fopenmp adds a libgomp.so.1
    # dependency that resolves to the copy torch already loaded, so the
    # process keeps one OpenMP runtime and one set of threads.
    openmp = ["-fopenmp"] if _torch_parallel_backend_is_openmp() else []
    return CppExtension("torch_kvswap._C", _rel(sources), extra_compile_args={"cxx": STRICT_CXX + openmp},
                        extra_link_args=openmp, py_limited_api=False)


def cuda_extension(decision: Decision):
    from torch.utils.cpp_extension import CUDAExtension

    # Host logic (cuda_engine.cpp), its binding to libcudart and torch
    # (cuda_api_real.cpp), and the kernel (copy_kernel.cu, nvcc).
    sources = [CSRC / "cuda" / "cuda_engine.cpp", CSRC / "cuda" / "cuda_api_real.cpp",
               CSRC / "cuda" / "copy_kernel.cu"]
    return CUDAExtension("torch_kvswap._C_cuda", _rel(sources), optional=not decision.forced,
                         extra_compile_args={"cxx": STRICT_CXX,
                                             "nvcc": ["-O3", "-Xcompiler", "-fvisibility=hidden"]})


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
    return CppExtension("torch_kvswap._C_npu", _rel(sorted((CSRC / "ascend").glob("*.cpp"))),
                        include_dirs=[str(include), str(include / "third_party" / "acl" / "inc")],
                        libraries=["dl"], optional=not decision.forced,
                        extra_compile_args={"cxx": STRICT_CXX}, extra_link_args=link_torch_npu)


def fake_cuda_extension(include: str):
    """The CUDA engine's host logic against the fake runtime (tests only)."""
    from torch.utils.cpp_extension import CppExtension

    fakes = ROOT / "tests" / "fake_cuda"
    sources = [fakes / "engine_under_test.cpp", fakes / "fake_cuda_runtime.cpp",
               fakes / "fake_cuda_module.cpp"]
    coverage = ["--coverage"] if flag("KVSWAP_FAKE_COVERAGE") else []
    return CppExtension("torch_kvswap._fake_cuda", _rel(sources), include_dirs=[include],
                        extra_compile_args={"cxx": [f for f in STRICT_CXX if f != "-O3"] + ["-O2"] + coverage},
                        extra_link_args=coverage)


@dataclass
class Engine:
    key: str  # "host", "cuda", "npu", "fake_cuda"
    module: str
    decision: Decision
    extension: object | None
    test_only: bool = False


def refuse_impossible_forced(cuda: Decision, npu: Decision) -> None:
    """An engine forced on (KVSWAP_BUILD_*=1) that cannot be built stops the build."""
    for d, what in ((cuda, "KVSWAP_BUILD_CUDA=1"), (npu, "KVSWAP_BUILD_NPU=1")):
        if d.forced and not d.build:
            raise SystemExit(f"{what} but the engine cannot be built: {d.reason}; {d.enable}")


def plan_engines(torch) -> list[Engine]:
    facts = gather_facts(torch)
    cuda, npu, fakes = decide_cuda(facts), decide_npu(facts), decide_fakes(facts)
    refuse_impossible_forced(cuda, npu)
    if cuda.build and cuda.arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda.arch_list
    return [
        Engine("host", "torch_kvswap._C", Decision(True, forced=True), core_extension()),
        Engine("cuda", "torch_kvswap._C_cuda", cuda, cuda_extension(cuda) if cuda.build else None),
        Engine("npu", "torch_kvswap._C_npu", npu,
               npu_extension(npu, facts.torch_npu_root) if npu.build else None),
        Engine("fake_cuda", "torch_kvswap._fake_cuda", fakes,
               fake_cuda_extension(facts.cuda_headers) if fakes.build else None, test_only=True),
    ]


# ---------------------------------------------------------------- build command


@contextmanager
def captured_output(log_path: Path, verbose: bool):
    """Sends the build's stdout/stderr (compiler command lines included) to
    log_path; on failure prints the log's tail and where the whole log is."""
    if verbose:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            tail = log_path.read_text(errors="replace").splitlines()[-120:]
            print("\n".join(tail), file=sys.stderr)
            print(f"torch_kvswap: build failed; the whole log is {log_path} "
                  "(KVSWAP_VERBOSE_BUILD=1 shows it as it runs)", file=sys.stderr)
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def make_build_command(torch, engines: list[Engine]):
    from torch.utils.cpp_extension import BuildExtension

    base = BuildExtension.with_options(use_ninja=True)

    class BuildWithSummary(base):
        """torch's BuildExtension, quiet, ending with one line per engine."""

        def build_extension(self, ext):
            # An engine found by detection that does not compile is left out
            # (setuptools skips copying a missing optional extension); the
            # host engine and forced engines fail the build.
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - reported in the summary
                if not getattr(ext, "optional", False):
                    raise
                self.failed[ext.name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

        def run(self):
            if not self.inplace:
                # Test-only fakes never go into a wheel or an installed tree.
                self.extensions = [e for e in self.extensions if not e.name.startswith("torch_kvswap._fake")]
                # An extension left in build/ by an earlier build, maybe for
                # another torch, looks up to date to setuptools: link anew
                # (ninja still recompiles only what changed).
                self.force = True
            built = {e.name for e in self.extensions}
            self.failed: dict[str, str] = {}  # extension name -> why it did not compile
            for line in plan_lines(torch.__version__, engines, built, os.environ.get("TORCH_CUDA_ARCH_LIST")):
                print(line, file=sys.stderr, flush=True)
            log = Path(tempfile.mkstemp(prefix="torch_kvswap-build-", suffix=".log")[1])
            with captured_output(log, bool(flag("KVSWAP_VERBOSE_BUILD"))):
                super().run()
            warnings = [line for line in log.read_text(errors="replace").splitlines()
                        if "warning:" in line] if log.exists() else []
            package_dir = Path(self.get_ext_fullpath("torch_kvswap._C")).parent
            if not self.inplace:
                # Only what this build built goes into the wheel: an extension
                # file in the build folder that this build did not write (a
                # test fake built in place and copied with the package's
                # files, or an engine of an earlier build) is removed.
                remove_stale_extensions(package_dir, {Path(self.get_ext_fullpath(e.name)).name
                                                      for e in self.extensions if e.name not in self.failed})
            info = self.build_info(built)
            (package_dir / "_build_info.json").write_text(json.dumps(info, indent=2) + "\n")
            for line in summary_lines(info):
                print(line, file=sys.stderr)
            if warnings or self.failed:
                print(f"torch_kvswap: {len(warnings)} compiler warning(s); the whole build log is {log}",
                      file=sys.stderr)
            else:
                log.unlink(missing_ok=True)

        def build_info(self, selected: set[str]) -> dict:
            out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                   "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"), "engines": {}}
            for e in engines:
                entry = {"module": e.module, "built": False, "test_only": e.test_only}
                if e.decision.build and e.module in selected:
                    if e.module not in self.failed:
                        # The file this record describes, so the record and
                        # what is installed cannot disagree.
                        path = Path(self.get_ext_fullpath(e.module))
                        entry["built"] = path.is_file()
                        entry["file"] = path.name
                        if not path.is_file():
                            entry["reason"] = f"the build wrote no {path.name}"
                            entry["enable"] = "rebuild with KVSWAP_VERBOSE_BUILD=1 and read the log"
                    else:
                        entry["reason"] = f"detected, but it failed to compile ({self.failed[e.module]})"
                        entry["enable"] = f"fix that error, or set KVSWAP_BUILD_{e.key.upper()}=0"
                elif e.decision.build:
                    entry["reason"] = "test-only; built only in place, never into a wheel"
                    entry["enable"] = FAKES_ENABLE
                else:
                    entry["reason"], entry["enable"] = e.decision.reason, e.decision.enable
                out["engines"][e.key] = entry
            return out

    return BuildWithSummary


#: Rough compile times on this project's 2-vCPU machine, per engine (CUDA:
#: per architecture), from clean builds on 2026-11-30 and 2026-12-01: the host
#: engine's 8 files took 3-4 minutes at load averages of 4-12 and 9 at 17-19;
#: an install on torch 2.15 with the CUDA engine for 4 architectures took 8
#: minutes. More cores cut them; other work on the machine stretches them.
ROUGH_MINUTES = {"host": (2, 5), "cuda": (1, 2), "npu": (1, 2), "fake_cuda": (1, 3)}


def extension_files(package_dir: Path) -> list[Path]:
    """The compiled extension modules in a package folder."""
    return sorted(p for p in package_dir.iterdir() if p.suffix in (".so", ".pyd"))


def remove_stale_extensions(package_dir: Path, keep: set[str]) -> list[str]:
    """Deletes every extension file of `package_dir` whose name is not in
    `keep`; returns the names removed."""
    removed = []
    for path in extension_files(package_dir):
        if path.name not in keep:
            path.unlink()
            removed.append(path.name)
    if removed:
        print(f"torch_kvswap: left out of this build's output, not built by it: {', '.join(removed)}",
              file=sys.stderr)
    return removed


def plan_lines(torch_version: str, engines: list[Engine], selected: set[str], arch_list: str | None) -> list[str]:
    """What the build is about to compile, each engine with a rough duration,
    printed before the compiler starts (the CUDA engine takes minutes per
    architecture). pip shows it with -v only."""
    names = {"host": "host engine (_C)", "cuda": "CUDA engine (_C_cuda)", "npu": "Ascend engine (_C_npu)",
             "fake_cuda": "test fake (_fake_cuda)"}
    low = high = 0
    lines = []
    for e in engines:
        if not (e.decision.build and e.module in selected):
            continue
        lo, hi = ROUGH_MINUTES[e.key]
        what = names[e.key]
        if e.key == "cuda" and arch_list:
            n = len([a for a in arch_list.split(";") if a])
            lo, hi = lo * n, hi * n
            what += f" for {n} architecture(s), {arch_list}"
            if n > 1:
                what += " (TORCH_CUDA_ARCH_LIST=<your GPU's, e.g. 9.0> builds one)"
        elif e.key == "cuda":
            what += " for the visible GPU's architecture"
        lines.append(f"  {what}: about {lo}-{hi} min")
        low, high = low + lo, high + hi
    cpus = os.cpu_count() or 1
    return [f"torch_kvswap: building against torch {torch_version}; from scratch about {low}-{high} min on 2 "
            f"CPUs (this machine has {cpus}), a rebuild compiles only what changed:", *lines]


def require_wheel_support() -> None:
    """pip builds through setuptools' bdist_wheel, which setuptools has only
    from 70.1 on; older ones need the `wheel` package (a fresh Python 3.11
    venv has setuptools 65 and no wheel)."""
    import setuptools

    if release(setuptools.__version__) < (70, 1) and importlib.util.find_spec("wheel") is None:
        raise SystemExit(f"setuptools {setuptools.__version__} cannot build wheels without the `wheel` "
                         f"package: pip install \"setuptools>=70.1\" ninja numpy, then {INSTALL_COMMAND}")


def main() -> None:
    torch = import_build_torch()
    require_wheel_support()
    if shutil.which("ninja") is None:
        print("warning: ninja not found; the build falls back to a slow serial compile", file=sys.stderr)
    engines = plan_engines(torch)
    # The metadata is in pyproject.toml ([project]).
    setup(
        packages=find_packages(include=["torch_kvswap", "torch_kvswap.*"]),
        ext_modules=[e.extension for e in engines if e.extension is not None],
        cmdclass={"build_ext": make_build_command(torch, engines)},
    )


if __name__ == "__main__":
    main()
