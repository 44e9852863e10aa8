"""What setup.py decides and how it builds, apart from what it compiles.

Not part of the package: the wheel holds only ``torch_kvswap`` (setup.py's
``packages``), and the source distribution carries this folder (MANIFEST.in)
so a wheel can be built from it.

* ``engines``: the facts a build reads (torch, the CUDA toolkit, torch_npu,
  the ``KVSWAP_BUILD_*`` switches) and which engines it builds from them; no
  torch import, so the decisions are tested with facts filled in by hand.
* ``build_command``: the ``build_ext`` command, quiet, printing what it will
  compile first, a line as each extension starts and ends, and one line per
  engine last (one line only when nothing is stale), and writing
  ``torch_kvswap/_build_info.json``; it imports torch's extension builder, so
  setup.py imports it only after checking the torch it found.

The install command, the version parse and the engine summary come from
``torch_kvswap/_build_shared.py``, which the package uses too. It is loaded by
its path: importing the package would load the extensions being built.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_build_shared():
    spec = importlib.util.spec_from_file_location(
        "torch_kvswap_build_shared", ROOT / "torch_kvswap" / "_build_shared.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _load_build_shared()
INSTALL_COMMAND = _shared.INSTALL_COMMAND
PREREQUISITES = _shared.PREREQUISITES
release = _shared.release  # (major, minor, patch) of a version string such as '2.13.0+cpu'
summary_lines = _shared.summary_lines


def flag(name: str, env=os.environ) -> bool | None:
    """Tri-state environment switch: True, False, or None for 'detect'."""
    value = env.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None
