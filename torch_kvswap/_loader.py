"""Loads the compiled extensions: the core (required) and the engines (optional).

The core ``_C`` holds every schema, the validation and the host engine; without
it the package cannot work, so a missing build is an ImportError that says how
to build. Each accelerator engine is a separate extension that registers one
kernel (``kvswap::_submit``) for its dispatch key. A missing or broken engine
never breaks the import: it is recorded in :data:`ENGINE_ERRORS` and the ops
raise a clear error only when a copy actually needs that engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import warnings
from pathlib import Path

import torch

INSTALL_COMMAND = "pip install --no-build-isolation ."

BUILD_HINT = (
    "torch_kvswap's compiled core (torch_kvswap._C) is not built. Build it against the "
    f"installed torch with `{INSTALL_COMMAND}` from the repository root (needs a C++ "
    "compiler and ninja), or run `bash scripts/test.sh`, which sets up everything."
)

#: Written by setup.py next to the extensions: the torch they were compiled
#: against and, per engine, whether it was built and why not.
BUILD_INFO_PATH = Path(__file__).resolve().parent / "_build_info.json"

#: Engines whose extension failed to load, name -> reason. Absent engines that
#: were simply not built are not listed.
ENGINE_ERRORS: dict[str, str] = {}


def build_info() -> dict | None:
    """What setup.py recorded about the build, or None (built by other means)."""
    try:
        return json.loads(BUILD_INFO_PATH.read_text())
    except (OSError, ValueError):
        return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def check_built_against(built: str, running: str) -> None:
    """Raises ImportError when the extensions were compiled against another
    torch release than the one running: torch's C++ ABI changes between
    releases, and loading them would fail with an undefined symbol, or worse."""
    if _release(built) != _release(running):
        raise ImportError(
            f"torch_kvswap was built against torch {built}, but torch {running} is installed; "
            "its compiled extensions only load under the torch they were built with. Rebuild it "
            f"against this torch: `{INSTALL_COMMAND}` from the source tree (add --force-reinstall "
            "--no-deps if pip considers it installed), or `bash scripts/test.sh` in a checkout.")


def load_core() -> None:
    info = build_info()
    if info is not None:
        check_built_against(info["torch"], torch.__version__)
    try:
        importlib.import_module("torch_kvswap._C")
    except ImportError as exc:
        hint = BUILD_HINT
        if "undefined symbol" in str(exc):
            hint = (f"torch_kvswap._C does not match torch {torch.__version__} (was it built against "
                    f"another torch?). Rebuild it against this torch with `{INSTALL_COMMAND}`.")
        raise ImportError(f"{hint}\n(underlying error: {exc})") from exc


def _load_optional(module: str, prerequisite: str | None) -> bool:
    if importlib.util.find_spec(module) is None:
        return False  # not built on this machine
    try:
        if prerequisite is not None:
            # torch_npu must register its PrivateUse1 backend before the
            # engine's kernels reference it.
            importlib.import_module(prerequisite)
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the host engine usable
        ENGINE_ERRORS[module] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"torch_kvswap: {module} could not be loaded ({exc}); "
                      "copies to that device will raise", RuntimeWarning, stacklevel=3)
        return False
    return True


def load_engines() -> dict[str, bool]:
    """Loads every built engine; returns which ones are active."""
    return {
        "cuda": _load_optional("torch_kvswap._C_cuda", None),
        "npu": _load_optional("torch_kvswap._C_npu", "torch_npu"),
    }
