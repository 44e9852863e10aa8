"""The demo and the benchmark CLI run end to end on small settings; the
benchmark's arithmetic is checked on made-up times."""

from __future__ import annotations

import json
import statistics

import pytest

from torch_kvswap import bench, demo


def test_demo_round_trip_succeeds(capsys):
    assert demo.main(["--layers", "2", "--cache-gib", "0.02", "--jobs", "3"]) == 0
    out = capsys.readouterr().out
    assert "verified every byte of 2 layers: OK" in out
    assert "job times from get_finished" in out


def test_ratios_are_paired_per_repetition():
    # Three repetitions of one size. Paired per repetition, contiguous/x is
    # [0.5, 2, 0.5] (median 0.5); the ratio of the medians would be 1.0 and
    # x/contiguous 2.0. index/x is [5, 3, 0.05] (median 3); unpaired 1.5.
    times = {(2.0, "contiguous"): [1.0, 2.0, 10.0],
             (2.0, "kvswap_tensor"): [2.0, 1.0, 20.0],
             (2.0, "index"): [10.0, 3.0, 1.0]}
    rows = {r.method: r for r in bench.summarize([(2.0, 4 * 10**9)], ["contiguous", "kvswap_tensor", "index"],
                                                 times)}
    x = rows["kvswap_tensor"]
    assert x.ratio_to_contiguous == pytest.approx(0.5)
    assert x.speedup_over_index == pytest.approx(3.0)
    assert x.seconds_median == 2.0 and x.seconds_all == [2.0, 1.0, 20.0]
    assert x.gbps == pytest.approx(2.0)  # 4 GB over the median 2 s
    assert rows["contiguous"].gbps == pytest.approx(2.0)
    assert rows["index"].gbps == pytest.approx(4 / 3)
    assert rows["index"].ratio_to_contiguous == pytest.approx(statistics.median([0.1, 2 / 3, 10.0]))
    # Against the run's median contiguous GB/s (one size here: 2 GB/s).
    assert rows["index"].ratio_to_run_limit == pytest.approx((4 / 3) / 2.0)


def test_the_run_limit_is_the_median_contiguous_copy_over_all_sizes():
    methods = ["contiguous", "kvswap_ptr"]
    times = {(k, m): [t] for k, t in [(2.0, 1.0), (4.0, 2.0), (8.0, 4.0)] for m in methods}
    times[8.0, "kvswap_ptr"] = [8.0]
    rows = bench.summarize([(2.0, 8 * 10**9), (4.0, 8 * 10**9), (8.0, 8 * 10**9)], methods, times)
    # contiguous GB/s: 8, 4, 2 -> the run's limit is 4 GB/s.
    by = {(r.block_kib, r.method): r for r in rows}
    assert by[8.0, "kvswap_ptr"].gbps == pytest.approx(1.0)
    assert by[8.0, "kvswap_ptr"].ratio_to_run_limit == pytest.approx(0.25)
    assert by[2.0, "contiguous"].ratio_to_run_limit == pytest.approx(2.0)
    assert all(r.speedup_over_index is None for r in rows)


def test_bench_writes_a_table_and_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--block-kib", "2", "16", "--total-mib", "4", "--layers", "1",
                       "--repeats", "3", "--json", str(path), "--host-modes", "memcpy"]) == 0
    out = capsys.readouterr().out
    assert "| 2 KiB |" in out and "| 16 KiB |" in out
    data = json.loads(path.read_text())
    methods = {r["method"] for r in data["rows"]}
    assert methods == set(bench.METHODS) | {"tensor[memcpy]"}
    # The ratios in the JSON are the paired medians of its own timings.
    by = {(r["block_kib"], r["method"]): r for r in data["rows"]}
    for r in data["rows"]:
        assert len(r["seconds_all"]) == 3 and all(t > 0 for t in r["seconds_all"])
        contiguous = by[r["block_kib"], "contiguous"]["seconds_all"]
        index = by[r["block_kib"], "index"]["seconds_all"]
        assert r["ratio_to_contiguous"] == pytest.approx(
            statistics.median(c / x for c, x in zip(contiguous, r["seconds_all"])))
        assert r["speedup_over_index"] == pytest.approx(
            statistics.median(i / x for i, x in zip(index, r["seconds_all"])))
        assert r["gbps"] > 0 and r["ratio_to_run_limit"] > 0
    assert "against the run's median contiguous copy" in out
    assert "speed-up over index_select + index_copy_" in out


def test_bench_without_index_has_no_speedup_column(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--block-kib", "4", "--total-mib", "1", "--layers", "1", "--repeats", "1",
                       "--methods", "contiguous", "kvswap_tensor", "--json", str(path)]) == 0
    assert "speed-up over index" not in capsys.readouterr().out
    assert all(r["speedup_over_index"] is None for r in json.loads(path.read_text())["rows"])
