"""Loads the compiled extensions: the core (required) and the engines (optional).

The core ``_C`` holds every schema, the validation and the host engine; without
it the package cannot work, so a missing build is an ImportError that says how
to build. Each accelerator engine is a separate extension that links the core
and, when its library loads (this import, or ``torch.ops.load_library``),
installs its table of functions (csrc/kvswap.h, EngineInterface: submit,
capture query, host registration, report, ...) in the core for its device
type. A missing or broken engine never breaks the import: it is
recorded in :data:`ENGINE_ERRORS` and the ops raise a clear error only when a
copy actually needs that engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch

from ._build_shared import INSTALL_COMMAND, release

BUILD_HINT = (
    "torch_kvswap's compiled core (torch_kvswap._C) is not built. Build it against the "
    f"installed torch with `{INSTALL_COMMAND}` from the repository root (needs a C++ "
    "compiler and ninja), or run `bash scripts/test.sh`, which sets up everything."
)

#: Written by setup.py next to the extensions: the torch they were compiled
#: against and, per engine, whether it was built and why not.
PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_INFO_PATH = PACKAGE_DIR / "_build_info.json"

#: Engines whose extension failed to load, name -> reason. Absent engines that
#: were simply not built are not listed.
ENGINE_ERRORS: dict[str, str] = {}


def build_info() -> dict | None:
    """What setup.py recorded about the build, or None (built by other means)."""
    try:
        return json.loads(BUILD_INFO_PATH.read_text())
    except (OSError, ValueError):
        return None


def unrecorded_extensions(info: dict, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Extension files in `package_dir` that the build record does not list
    as built: leftovers of another build (a test fake built in place, an
    engine compiled for another torch) that this install should not hold."""
    built = {
        entry["module"].rsplit(".", 1)[1] for entry in info.get("engines", {}).values() if entry.get("built")
    }
    return sorted(
        p.name
        for p in package_dir.iterdir()
        if p.suffix in (".so", ".pyd") and p.name.split(".", 1)[0] not in built
    )


def is_source_tree(package_dir: Path) -> bool:
    """Whether `package_dir` is the package folder of a clone (built in place)
    rather than an installed copy: setup.py and csrc/ sit beside it."""
    return (package_dir.parent / "setup.py").is_file() and (package_dir.parent / "csrc").is_dir()


def rebuild_hint(package_dir: Path, cwd: Path | None = None) -> str:
    """How to get extensions for the running torch, for the copy of the
    package at `package_dir`: where it came from decides the fix."""
    cwd = Path.cwd() if cwd is None else cwd
    if not is_source_tree(package_dir):
        return (
            f"This copy was imported from {package_dir}. Rebuild it against this torch: "
            f"`{INSTALL_COMMAND}` from the source tree (add --force-reinstall --no-deps if pip "
            "considers it installed), or `bash scripts/test.sh` in a checkout."
        )
    tree = package_dir.parent
    where = f"This copy was imported from {package_dir}, the package folder of the source tree {tree}"
    if tree.resolve() == cwd.resolve():
        where += (
            ", because Python puts the current directory first on its path: it shadows any "
            "torch_kvswap installed for this torch, and reinstalling does not change that"
        )
    return (
        f"{where}. Either run from another directory (then an installed torch_kvswap is "
        f"imported), or rebuild this tree in place: `cd {tree} && {sys.executable} setup.py "
        "build_ext --inplace` for this torch, or `bash scripts/test.sh`, which does it for the "
        "tree's own .venv."
    )


def check_built_against(built: str, running: str, package_dir: Path | None = None) -> None:
    """Raises ImportError when the extensions were compiled against another
    torch release than the one running: torch's C++ ABI changes between
    releases, and loading them would fail with an undefined symbol, or worse.
    The message names the folder the package came from and the fix for it."""
    if release(built) != release(running):
        raise ImportError(
            f"torch_kvswap was built against torch {built}, but torch {running} is installed; "
            "its compiled extensions only load under the torch they were built with. "
            + rebuild_hint(PACKAGE_DIR if package_dir is None else package_dir)
        )


def load_core() -> None:
    info = build_info()
    if info is not None:
        check_built_against(info["torch"], torch.__version__)
    try:
        importlib.import_module("torch_kvswap._C")
    except ImportError as exc:
        hint = BUILD_HINT
        if "undefined symbol" in str(exc):
            hint = (
                f"torch_kvswap._C does not match torch {torch.__version__} (was it built against "
                f"another torch?). {rebuild_hint(PACKAGE_DIR)}"
            )
        raise ImportError(f"{hint}\n(underlying error: {exc})") from exc


def _load_optional(module: str, prerequisite: str | None, recorded: dict | None = None) -> bool:
    if importlib.util.find_spec(module) is None:
        return False  # not built on this machine
    if recorded is not None and not recorded.get("built"):
        # A file the last build did not write: left by an earlier build,
        # maybe for another torch, whose loading could crash the process.
        ENGINE_ERRORS[module] = (
            "a leftover file that the last build did not build "
            f"({recorded.get('reason', 'no reason recorded')}); not loaded"
        )
        warnings.warn(f"torch_kvswap: {module} is {ENGINE_ERRORS[module]}", RuntimeWarning, stacklevel=3)
        return False
    try:
        if prerequisite is not None:
            # torch_npu must register its PrivateUse1 backend before the
            # engine's kernels reference it.
            importlib.import_module(prerequisite)
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the host engine usable
        ENGINE_ERRORS[module] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"torch_kvswap: {module} could not be loaded ({exc}); copies to that device will raise",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


#: Engine key -> (name as reports print it, its extension).
ENGINE_NAMES = {
    "host": ("host engine", "torch_kvswap._C"),
    "cuda": ("CUDA engine", "torch_kvswap._C_cuda"),
    "npu": ("Ascend engine", "torch_kvswap._C_npu"),
}

#: Which engine a copy goes to, by the device type of its accelerator tensor
#: (a copy between host tensors only goes to the host engine); csrc/core/engines.cpp
#: routes the same way.
_ENGINE_OF_DEVICE_TYPE = {"cpu": "host", "cuda": "cuda", "npu": "npu", "privateuseone": "npu"}


def engine_for(device: torch.device | str) -> str | None:
    """The engine (a key of :data:`ENGINE_NAMES`) that moves the bytes of a
    copy on ``device``, or None when no engine serves it (the copy would
    raise). This is the engine the core holds for that device type
    (``kvswap::_engines``), not merely an extension that loaded: a CUDA
    engine loaded on a machine with no GPU moves nothing, as every copy
    there is between host tensors."""
    key = _ENGINE_OF_DEVICE_TYPE.get(torch.device(device).type)
    if key is None:
        return None
    served = {_ENGINE_OF_DEVICE_TYPE.get(t) for t in torch.ops.kvswap._engines()}
    return key if key in served else None


def load_engines() -> dict[str, bool]:
    """Loads every built engine; returns which ones are active."""
    engines = (build_info() or {}).get("engines")

    def recorded(key: str) -> dict | None:  # None: no record to check against
        return None if engines is None else engines.get(key, {})

    return {
        "cuda": _load_optional("torch_kvswap._C_cuda", None, recorded("cuda")),
        "npu": _load_optional("torch_kvswap._C_npu", "torch_npu", recorded("npu")),
    }
