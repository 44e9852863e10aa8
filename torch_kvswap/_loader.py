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
import warnings

BUILD_HINT = (
    "torch_kvswap's compiled core (torch_kvswap._C) is not built. Build it against the "
    "installed torch with `pip install --no-build-isolation -e .` from the repository "
    "root (needs a C++ compiler and ninja), or run `bash scripts/test.sh`, which sets up "
    "everything."
)

#: Engines whose extension failed to load, name -> reason. Absent engines that
#: were simply not built are not listed.
ENGINE_ERRORS: dict[str, str] = {}


def load_core() -> None:
    try:
        importlib.import_module("torch_kvswap._C")
    except ImportError as exc:
        raise ImportError(f"{BUILD_HINT}\n(underlying error: {exc})") from exc


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
