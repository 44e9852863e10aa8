"""Which engines a build compiles: the facts it reads, then one decision per
engine (built, or why not and how to enable it). The decisions take the facts
as an argument, so tests decide for machines they do not have."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import flag, release

#: CUDA architectures compiled when no GPU is visible and
#: TORCH_CUDA_ARCH_LIST is unset: Ampere (8.0; also runs on 8.6/8.9), Hopper
#: (9.0), Blackwell data centre (10.0) and consumer (12.0), plus PTX for newer
#: GPUs. Architectures the installed nvcc cannot target are dropped.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"

FAKES_ENABLE = "KVSWAP_BUILD_FAKES=1 python setup.py build_ext --inplace (scripts/test.sh does)"


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


@dataclass
class Engine:
    key: str  # "host", "cuda", "npu", "fake_cuda"
    module: str
    decision: Decision
    extension: object | None
    test_only: bool = False


# ---------------------------------------------------------------- decisions


def decide_cuda(f: Facts) -> Decision:
    wanted = flag("KVSWAP_BUILD_CUDA", f.env)
    if wanted is False:
        return Decision(False, "KVSWAP_BUILD_CUDA=0", "unset KVSWAP_BUILD_CUDA")
    forced = wanted is True
    if not f.torch_cuda and not forced:
        return Decision(
            False,
            f"torch {f.torch_version} is not a CUDA build",
            "install a CUDA build of torch and a CUDA toolkit of the same major version",
        )
    if f.cuda_home is None or f.nvcc_version is None:
        return Decision(
            False,
            "no CUDA toolkit found (nvcc with cuda_runtime_api.h beside it)",
            "install the CUDA toolkit or set CUDA_HOME to it",
            forced,
        )
    if f.torch_cuda and release(f.torch_cuda)[0] != release(f.nvcc_version)[0]:
        return Decision(
            False,
            f"nvcc {f.nvcc_version} and torch's CUDA {f.torch_cuda} differ in major "
            "version, which torch's extension builder refuses",
            f"install CUDA toolkit {release(f.torch_cuda)[0]}.x and set CUDA_HOME to it",
            forced,
        )
    arch_list = f.env.get("TORCH_CUDA_ARCH_LIST") or None
    if arch_list is None and f.visible_gpus == 0:
        arch_list = default_cuda_archs(f.nvcc_archs)
        if not arch_list:
            return Decision(
                False,
                f"nvcc {f.nvcc_version} targets none of {DEFAULT_CUDA_ARCHS}",
                "set TORCH_CUDA_ARCH_LIST",
                forced,
            )
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
        return Decision(
            False,
            "torch_npu is not installed",
            f"pip install torch-npu=={'.'.join(map(str, release(f.torch_version)))} "
            "(torch_npu is all the build needs; CANN is found at run time)",
            bool(wanted),
        )
    return Decision(True, forced=bool(wanted))


def decide_fakes(f: Facts) -> Decision:
    if not flag("KVSWAP_BUILD_FAKES", f.env):
        return Decision(False, "test-only", FAKES_ENABLE)
    if f.cuda_headers is None:
        return Decision(
            False,
            "no CUDA runtime headers found (CUDA_HOME, nvcc's toolkit, /usr/local/cuda)",
            "install the CUDA toolkit's headers",
        )
    return Decision(True)


def refuse_impossible_forced(cuda: Decision, npu: Decision) -> None:
    """An engine forced on (KVSWAP_BUILD_*=1) that cannot be built stops the build."""
    for d, what in ((cuda, "KVSWAP_BUILD_CUDA=1"), (npu, "KVSWAP_BUILD_NPU=1")):
        if d.forced and not d.build:
            raise SystemExit(f"{what} but the engine cannot be built: {d.reason}; {d.enable}")


# ---------------------------------------------------------------- facts


def _nvcc_facts(cuda_home: str | None) -> tuple[str | None, list[str]]:
    if cuda_home is None:
        return None, []
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
        archs = subprocess.run(
            [str(nvcc), "--list-gpu-arch"], capture_output=True, text=True, timeout=60
        ).stdout
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
        if (
            home
            and (Path(home) / "include" / "cuda_runtime_api.h").is_file()
            and (Path(home) / "bin" / "nvcc").is_file()
        ):
            return str(Path(home))
    return None


def _torch_npu_root() -> Path | None:
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
    return Facts(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_home=cuda_home,
        nvcc_version=nvcc_version,
        nvcc_archs=nvcc_archs,
        visible_gpus=visible,
        torch_npu_root=_torch_npu_root(),
        cuda_headers=str(Path(cuda_home) / "include") if cuda_home else None,
        env=dict(os.environ),
    )
