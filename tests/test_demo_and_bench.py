"""The demo and the benchmark CLI run end to end on small settings; the
benchmark's arithmetic is checked on made-up times; both refuse bad options
at once and say which engine moved the bytes and where their output went."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest
import torch

import torch_kvswap
from fake_device import engine_spy
from torch_kvswap import _loader
from torch_kvswap.bench import demo
from torch_kvswap.bench import throughput as bench


def test_demo_round_trip_succeeds(capsys):
    assert demo.main(["--layers", "2", "--cache-gib", "0.02", "--jobs", "3"]) == 0
    out = capsys.readouterr().out
    assert "verified every byte of 2 layers: OK" in out
    assert "job times from get_finished" in out


def test_ratios_are_paired_per_repetition():
    # Three repetitions of one size. Paired per repetition, contiguous/x is
    # [0.5, 2, 0.5] (median 0.5); the ratio of the medians would be 1.0 and
    # x/contiguous 2.0. index/x is [5, 3, 0.05] (median 3); unpaired 1.5.
    times = {
        (2.0, "contiguous"): [1.0, 2.0, 10.0],
        (2.0, "kvswap_tensor"): [2.0, 1.0, 20.0],
        (2.0, "index"): [10.0, 3.0, 1.0],
    }
    rows = {
        r.method: r
        for r in bench.summarize([(2.0, 4 * 10**9)], ["contiguous", "kvswap_tensor", "index"], times)
    }
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
    assert (
        bench.main(
            [
                "--block-kib",
                "2",
                "16",
                "--total-mib",
                "4",
                "--layers",
                "1",
                "--repeats",
                "3",
                "--json",
                str(path),
                "--host-modes",
                "memcpy",
            ]
        )
        == 0
    )
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
            statistics.median(c / x for c, x in zip(contiguous, r["seconds_all"]))
        )
        assert r["speedup_over_index"] == pytest.approx(
            statistics.median(i / x for i, x in zip(index, r["seconds_all"]))
        )
        assert r["gbps"] > 0 and r["ratio_to_run_limit"] > 0
    assert "against the run's median contiguous copy" in out
    assert "speed-up over index_select + index_copy_" in out


def test_bench_without_index_has_no_speedup_column(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert (
        bench.main(
            [
                "--block-kib",
                "4",
                "--total-mib",
                "1",
                "--layers",
                "1",
                "--repeats",
                "1",
                "--methods",
                "contiguous",
                "kvswap_tensor",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    assert "speed-up over index" not in capsys.readouterr().out
    assert all(r["speedup_over_index"] is None for r in json.loads(path.read_text())["rows"])


# ---------------------------------------------------------------- which engine moved the bytes


def test_the_demo_names_the_engine_whose_kernel_received_every_byte(capsys, monkeypatch):
    # A CUDA build of torch with no GPU loads the CUDA engine, yet every copy
    # is between host tensors: the host engine (recorded here) receives them
    # all, and that is the engine the demo must name.
    monkeypatch.setitem(torch_kvswap.ENGINES, "cuda", True)
    with engine_spy("CPU") as calls:
        assert demo.main(["--layers", "2", "--cache-gib", "0.02", "--jobs", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    moved = re.search(r"moved \d+ device blocks \((\d+) MiB\) each way", out)
    assert calls and all(c.device.type == "cpu" for c in calls)
    assert sum(sum(c.sizes) for c in calls) == 2 * int(moved.group(1)) * 2**20
    first = out.splitlines()[0]
    assert first == (
        "torch_kvswap demo on cpu: copies run on the host engine (torch_kvswap._C); "
        "loaded, unused here: CUDA engine"
    ), first
    assert "the host engine (torch_kvswap._C) moved" in out
    assert "engines loaded" not in out


def test_engine_for_a_device_is_the_one_the_core_holds_for_its_type():
    assert _loader.engine_for("cpu") == "host"
    has_cuda = "cuda" in torch.ops.kvswap._engines()
    assert _loader.engine_for("cuda") == ("cuda" if has_cuda else None)
    assert _loader.engine_for("meta") is None


def test_engine_for_follows_the_engine_the_core_holds():
    # Installing an engine for the stand-in device is what makes it served.
    assert _loader.engine_for("privateuseone") is None
    with engine_spy("PrivateUse1"):
        assert _loader.engine_for("privateuseone") == "npu"
    assert _loader.engine_for("privateuseone") is None


# -------------------------------------------------------------- help (the demo's options: test_demo_usage.py)


@pytest.mark.parametrize("module", [demo, bench])
def test_help_explains_every_option_with_its_default(module, capsys):
    parser = module.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = parser._get_formatter()._expand_help(action)
        assert action.help and " ".join(text.split()) in shown, action.dest
        if action.default is not None and action.default is not False:
            assert "(default: " in text, text


# ---------------------------------------------------------------- bench output


def test_bench_refuses_plot_without_matplotlib_before_the_run(monkeypatch, capsys):
    monkeypatch.setattr(bench, "matplotlib_available", lambda: False)
    monkeypatch.setattr(bench, "run_sizes", lambda *a: pytest.fail("the bench ran"))
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--plot", "out.png"])
    assert exit_.value.code == 2
    assert "--plot out.png needs matplotlib, which is not installed" in capsys.readouterr().err


def test_bench_prints_where_it_wrote_the_json_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    data, png = tmp_path / "b.json", tmp_path / "b.png"
    assert (
        bench.main(
            [
                "--block-kib",
                "4",
                "--total-mib",
                "1",
                "--layers",
                "1",
                "--repeats",
                "1",
                "--methods",
                "contiguous",
                "kvswap_tensor",
                "--json",
                str(data),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"wrote the results to {data}" in out and f"wrote the plot to {png}" in out
    assert data.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_ticks_only_the_measured_block_sizes():
    pytest.importorskip("matplotlib")
    rows = [bench.Row(kib, m, 1.0 + kib, 1.0, 1.0) for kib in (2.0, 16.0, 256.0) for m in ("contiguous", "x")]
    fig = bench.make_figure(rows, "t")
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [2.0, 16.0, 256.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "16", "256"]
    assert len(ax.xaxis.get_minorticklocs()) == 0


def test_the_benches_run_with_python_m_and_stay_out_of_the_package_import():
    for module, prog in [
        ("torch_kvswap.bench", "python -m torch_kvswap.bench"),
        ("torch_kvswap.bench.demo", "python -m torch_kvswap.bench.demo"),
        ("torch_kvswap.bench.vllm_backend", "python -m torch_kvswap.bench.vllm_backend"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {prog}"), (
            module,
            proc.stdout,
            proc.stderr,
        )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch_kvswap; "
            "print(sorted(m for m in sys.modules if m.startswith('torch_kvswap.bench')))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
