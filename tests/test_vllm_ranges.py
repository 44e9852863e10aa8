"""The supported vLLM ranges, one table (compat.PLUGIN_RANGES), shown alike everywhere.

docs/vllm.md's table, the README's statement and ``python -m torch_kvswap``
must show the ranges of compat.py, and compat's own range constants must be
the table's. Needs no vLLM.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch_kvswap import envreport
from torch_kvswap.integrations.vllm import compat

ROOT = Path(__file__).resolve().parents[1]


def ranges_in(text: str) -> dict[str, str]:
    """``| `Name` | a.b to c.d |`` rows of a markdown table."""
    return dict(re.findall(r"^\| `(KVSwap\w+)` \| (\d+\.\d+ to \d+\.\d+) \|$", text, re.M))


def test_docs_vllm_table_is_compats_table():
    table = ranges_in((ROOT / "docs" / "vllm.md").read_text())
    assert table == {name: compat.range_text(name) for name in compat.PLUGIN_RANGES}


def test_the_readme_states_compats_ranges():
    readme = (ROOT / "README.md").read_text()
    assert f"The vLLM plug-ins support: {compat.supported_ranges()}." in readme
    stated = set(re.findall(r"vLLM (\d+\.\d+ to \d+\.\d+)", readme))
    assert stated <= {compat.range_text(name) for name in compat.PLUGIN_RANGES}


def test_the_environment_report_without_vllm_names_compats_ranges(monkeypatch):
    monkeypatch.setattr(envreport.importlib.util, "find_spec", lambda name: None)
    assert envreport.vllm_rows() == [
        ("vLLM", f"not installed (the plug-ins need vLLM {compat.supported_ranges()})")
    ]


def test_compats_range_constants_are_the_tables():
    assert compat.SUPPORTED_RANGE == compat.PLUGIN_RANGES["KVSwapOffloadingSpec"]
    assert compat.HANDLER_RANGE == compat.PLUGIN_RANGES["KVSwapOffloadingHandler"]
    assert compat.PLUGIN_RANGES["KVSwapTieringOffloadingSpec"] == (
        compat.TIERING_FROM,
        compat.SUPPORTED_RANGE[1],
    )
    assert compat.supported_ranges() == (
        "KVSwapOffloadingHandler 0.23 to 0.24; KVSwapOffloadingSpec 0.25 to 0.33; "
        "KVSwapTieringOffloadingSpec 0.26 to 0.33; "
        "KVSwapSimpleCPUOffloadConnector 0.25 to 0.33"
    )


def test_the_conformance_matrix_covers_every_minor_release_of_every_range():
    minors = {
        tuple(int(x) for x in spec.split("==")[1].split(".")[:2]) for spec in compat.CONFORMANCE_RELEASES
    }
    low = min(lo for lo, _ in compat.PLUGIN_RANGES.values())
    high = max(hi for _, hi in compat.PLUGIN_RANGES.values())
    assert minors == {(0, m) for m in range(low[1], high[1] + 1)}


def test_the_chunk_count_error_names_compats_releases():
    import pytest

    from torch_kvswap.integrations.vllm.offloading import _host_chunks

    assert compat.chunk_count_names() == (("num_chunks", "0.30 on"), ("num_blocks", "0.25 to 0.29"))
    assert compat.chunk_count_names()[1][1].startswith(compat.range_text("KVSwapOffloadingSpec").split()[0])
    with pytest.raises(
        TypeError,
        match=r"^object: vLLM's CPUOffloadingSpec set neither num_chunks "
        r"\(vLLM 0\.30 on\) nor num_blocks \(vLLM 0\.25 to 0\.29\)$",
    ):
        _host_chunks(object())
