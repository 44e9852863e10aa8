"""What the build (setup.py) and the package both say about a build: the
install command, how a version string is compared, and how an engine's entry
of the build record (``_build_info.json``) reads.

setup.py cannot import the package (its ``__init__`` loads the compiled
extensions), so it loads this file by its path; hence only the standard
library here.
"""

from __future__ import annotations

import re

INSTALL_COMMAND = "pip install --no-build-isolation ."


def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '2.13.0+cpu'; the
    local tag after '+' (the build variant) does not count."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def engine_state(key: str, entry: dict, cuda_arch_list: str | None = None) -> str:
    """An engine's entry of the build record in words: 'built' (the CUDA
    engine with its architectures), or 'not built: <reason>; to enable: <what>'."""
    if entry.get("built"):
        return f"built for {cuda_arch_list}" if key == "cuda" and cuda_arch_list else "built"
    return f"not built: {entry.get('reason')}; to enable: {entry.get('enable')}"


def summary_lines(info: dict) -> list[str]:
    """One line per engine of a build record, as printed at the end of a build."""
    names = {"host": "host engine   (_C)", "cuda": "CUDA engine   (_C_cuda)",
             "npu": "Ascend engine (_C_npu)", "fake_cuda": "test fake     (_fake_cuda)"}
    lines = [f"torch_kvswap: built against torch {info['torch']}"]
    for key, entry in info["engines"].items():
        lines.append(f"  {names.get(key, key)}: {engine_state(key, entry, info.get('cuda_arch_list'))}")
    return lines
