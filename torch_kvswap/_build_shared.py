"""What the build (setup.py) and the package both say about a build: the
install command, how a version string is compared, and how an engine's entry
of the build record (``_build_info.json``) reads.

setup.py cannot import the package (its ``__init__`` loads the compiled
extensions), so it loads this file by its path; hence only the standard
library at module level (``release`` imports ``packaging`` when called).
"""

from __future__ import annotations

INSTALL_COMMAND = "pip install --no-build-isolation ."
#: What the build needs before INSTALL_COMMAND (README.md's install line is
#: ``f"{PREREQUISITES} && {INSTALL_COMMAND}"``). ``torch`` installs nothing
#: where torch is installed: it makes pip resolve setuptools together with the
#: installed torch's own requirements (torch 2.11 and 2.12 require
#: setuptools < 82; without it pip takes the newest, 84, and reports a
#: conflict). setuptools 70.1 is the first that builds wheels itself.
PREREQUISITES = 'pip install "setuptools>=70.1" ninja numpy torch'


def release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string, read by ``packaging.version``
    (torch's vendored copy where packaging is not installed): the local tag
    after '+' (the build variant) and the pre-, post- and dev-release parts do
    not count, and a missing part is 0, so '2.10' and '2.10.0.post4' are both
    (2, 10, 0). A string that is not a version raises ``ValueError`` naming it."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # setuptools vendors its own; torch does too
        from torch._vendor.packaging.version import InvalidVersion, Version
    try:
        parts = Version(version).release
    except InvalidVersion:
        raise ValueError(f"{version!r} is not a version string (PEP 440)") from None
    return (tuple(parts) + (0, 0))[:3]


def engine_state(key: str, entry: dict, cuda_arch_list: str | None = None) -> str:
    """An engine's entry of the build record in words: 'built' (the CUDA
    engine with its architectures), or 'not built: <reason>; to enable: <what>'."""
    if entry.get("built"):
        return f"built for {cuda_arch_list}" if key == "cuda" and cuda_arch_list else "built"
    return f"not built: {entry.get('reason')}; to enable: {entry.get('enable')}"


def summary_lines(info: dict) -> list[str]:
    """One line per engine of a build record, as printed at the end of a build."""
    names = {
        "host": "host engine   (_C)",
        "cuda": "CUDA engine   (_C_cuda)",
        "npu": "Ascend engine (_C_npu)",
        "fake_cuda": "test fake     (_fake_cuda)",
    }
    lines = [f"torch_kvswap: built against torch {info['torch']}"]
    for key, entry in info["engines"].items():
        lines.append(f"  {names.get(key, key)}: {engine_state(key, entry, info.get('cuda_arch_list'))}")
    return lines
