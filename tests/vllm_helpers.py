"""Helpers shared by the vLLM plug-in tests.

Imported as ``vllm_helpers`` (pytest puts tests/ on the path, as for
``helpers``).
"""

from __future__ import annotations

import sys

#: The plug-in's modules whose classes subclass vLLM's: each imports vLLM
#: (and checks its interface) when it is first imported.
PLUGIN_CLASS_MODULES = tuple(f"torch_kvswap.integrations.vllm.{name}"
                             for name in ("offloading_spec", "tiering_spec", "simple_connector"))


def forget_plugin_classes(monkeypatch) -> None:
    """Makes the next lookup of a plug-in class import its module afresh, on
    the vLLM installed now (a stand-in, or the real one under another
    version): the modules built before are put back when the test ends."""
    for name in PLUGIN_CLASS_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # recorded, to be put back (or removed) after the test
        del sys.modules[name]

