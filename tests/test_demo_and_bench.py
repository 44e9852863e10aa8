"""The demo and the benchmark CLI run end to end on small settings."""

from __future__ import annotations

import json

from torch_kvswap import bench, demo


def test_demo_round_trip_succeeds(capsys):
    assert demo.main(["--layers", "2", "--cache-gib", "0.02", "--jobs", "3"]) == 0
    out = capsys.readouterr().out
    assert "verified every byte of 2 layers: OK" in out
    assert "job times from get_finished" in out


def test_bench_writes_a_table_and_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--block-kib", "2", "16", "--total-mib", "4", "--layers", "1",
                       "--repeats", "2", "--json", str(path), "--host-modes", "memcpy"]) == 0
    out = capsys.readouterr().out
    assert "| 2 KiB |" in out and "| 16 KiB |" in out
    data = json.loads(path.read_text())
    methods = {r["method"] for r in data["rows"]}
    assert methods == set(bench.METHODS) | {"tensor[memcpy]"}
    limit = [r for r in data["rows"] if r["method"] == "contiguous"]
    assert all(r["ratio_to_contiguous"] == 1.0 for r in limit)
    assert all(r["gbps"] > 0 and r["ratio_to_run_limit"] > 0 for r in data["rows"])
    assert "against the run's median contiguous copy" in out
    index = {r["block_kib"]: r for r in data["rows"] if r["method"] == "index"}
    assert all(r["speedup_over_index"] == 1.0 for r in index.values())
    assert all(r["speedup_over_index"] > 0 for r in data["rows"])
    assert "speed-up over index_select + index_copy_" in out


def test_bench_without_index_has_no_speedup_column(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--block-kib", "4", "--total-mib", "1", "--layers", "1", "--repeats", "1",
                       "--methods", "contiguous", "kvswap_tensor", "--json", str(path)]) == 0
    assert "speed-up over index" not in capsys.readouterr().out
    assert all(r["speedup_over_index"] is None for r in json.loads(path.read_text())["rows"])
