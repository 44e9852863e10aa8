"""The GPU kit's own checks (scripts/gpu_report.py) and scripts/gpu_check.sh's arguments.

The kit gets one short lease on a GPU machine, whose tool returns at most 8
files of $OUT, none deeper than 2 folders, with plain names: these tests hold
its rules, the bench's crossover and the goals' verdicts to hand-made inputs,
without torch's CUDA or a GPU. The dry run itself runs in CI (.ci/run) and
fails when its own final check does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

_spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


def write(path: pathlib.Path, text: str = "{}") -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- $OUT under the device's rules ----------------------------------------------------------


def test_an_out_folder_of_four_valid_files_passes(tmp_path):
    for name in ("summary.json", "probe.json", "bench.json", "logs.tar.gz"):
        write(tmp_path / name)
    problems, files = R.check_out(str(tmp_path), ["summary.json", "probe.json"])
    assert problems == [] and sorted(files) == ["bench.json", "logs.tar.gz", "probe.json", "summary.json"]


def test_more_than_six_files_are_refused(tmp_path):
    for i in range(7):
        write(tmp_path / f"f{i}.txt")
    problems, _ = R.check_out(str(tmp_path))
    assert problems == ["7 files, at most 6 allowed: f0.txt, f1.txt, f2.txt, f3.txt, f4.txt, f5.txt, f6.txt"]


def test_folders_and_the_files_in_them_are_refused(tmp_path):
    write(tmp_path / "summary.json")
    write(tmp_path / "cache" / "a" / "b.bin")
    problems, files = R.check_out(str(tmp_path))
    assert "cache: a folder (only files at the top level)" in problems
    assert os.path.join("cache", "a") + ": a folder (only files at the top level)" in problems
    assert os.path.join("cache", "a", "b.bin") in files


@pytest.mark.parametrize("name", ["my log.txt", "résumé.json", "a:b"])
def test_names_outside_letters_digits_dot_underscore_dash_are_refused(tmp_path, name):
    write(tmp_path / name)
    problems, _ = R.check_out(str(tmp_path))
    assert problems == [f"{name}: name has characters other than letters, digits, '.', '_', '-'"]


def test_a_file_over_16_mib_is_refused(tmp_path):
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(R.MAX_FILE_BYTES + 1)  # sparse: no 16 MiB written
    problems, _ = R.check_out(str(tmp_path))
    assert problems == [f"big.bin: {R.MAX_FILE_BYTES + 1} bytes, over {R.MAX_FILE_BYTES}"]


def test_a_link_is_refused(tmp_path):
    write(tmp_path / "summary.json")
    os.symlink(tmp_path / "summary.json", tmp_path / "copy.json")
    problems, _ = R.check_out(str(tmp_path))
    assert problems == ["copy.json: not a plain file"]


def test_required_files_must_exist_and_json_must_parse(tmp_path):
    write(tmp_path / "probe.json", "{not json")
    problems, _ = R.check_out(str(tmp_path), ["summary.json", "probe.json"])
    assert problems[0] == "summary.json: missing"
    assert problems[1].startswith("probe.json: not valid JSON")


# --- logs: cut to fit, one tarball ---------------------------------------------------------


def test_a_long_log_keeps_its_head_and_tail_within_the_limit():
    data = bytes(range(256)) * 10_000
    got = R.cut(data, limit=100_000, head=10_000)
    assert got.startswith(data[:10_000]) and got.endswith(data[-90_000:])
    assert b"bytes cut" in got and len(got) < 100_000 + 100
    assert R.cut(b"short") == b"short"


def test_every_log_goes_into_one_tarball(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "build.log", "built\n")
    (logs / "bench.log").write_bytes(b"x" * (R.LOG_CUT_BYTES + 5000))
    target = tmp_path / "logs.tar.gz"
    R.pack_logs(str(logs), str(target))
    with tarfile.open(target) as tar:
        assert sorted(tar.getnames()) == ["bench.log", "build.log"]
        assert tar.extractfile("build.log").read() == b"built\n"
        assert len(tar.extractfile("bench.log").read()) < R.LOG_CUT_BYTES + 100
    assert not (tmp_path / "logs.tar.gz.part").exists()


# --- what the steps' logs say ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, errors",
    [
        ("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", 0),
        ("========= Invalid __global__ write\n========= ERROR SUMMARY: 3 errors\n", 3),
        ("========= ERROR SUMMARY: 1 error\n", 1),
        ("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n", 1),
        ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0),
        ("pytest output only, the sanitizer was cut short\n", None),
    ],
)
def test_sanitizer_summaries_are_read(text, errors):
    assert R.sanitizer_errors(text) == errors


def test_junit_counts(tmp_path):
    xml = write(
        tmp_path / "t.xml",
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"></testsuite></testsuites>',
    )
    assert R.junit_counts(str(xml)) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2, "passed": 2}
    assert R.junit_counts(str(tmp_path / "none.xml")) is None
    assert R.junit_counts(str(write(tmp_path / "bad.xml", "<oops"))) is None


# --- the bench: grid, crossover, goals ------------------------------------------------------


def grid_rows(gbps, vs=1.0):
    """A complete bench: gbps(direction, kib, path) per row, vs_contiguous `vs` for DMA rows."""
    rows = []
    for d in R.DIRECTIONS:
        for k in R.BLOCK_KIB:
            for n in R.DESCRIPTORS:
                for p in R.PATHS:
                    rows.append(
                        {
                            "direction": d,
                            "block_kib": k,
                            "descriptors": n,
                            "descriptors_asked": n,
                            "path": p,
                            "ok": True,
                            "gbps": gbps(d, k, p),
                            "vs_contiguous": vs if p == "batch_dma" else 1.0,
                        }
                    )
    rows += [
        {
            "direction": "d2d",
            "block_kib": R.D2D_KIB,
            "descriptors": n,
            "descriptors_asked": n,
            "path": p,
            "ok": True,
            "gbps": 1.0,
        }
        for n in R.DESCRIPTORS
        for p in R.PATHS
    ]
    return {"results": rows}


def test_a_complete_bench_misses_no_row_and_a_gap_is_named():
    bench = grid_rows(lambda d, k, p: 1.0)
    assert R.missing_rows(bench) == []
    bench["results"] = [
        r
        for r in bench["results"]
        if not (
            r["direction"] == "d2h"
            and r["block_kib"] == 48
            and r["path"] == "kernel"
            and r["descriptors_asked"] == 4096
        )
    ]
    assert R.missing_rows(bench) == ["d2h 48 KiB x 4096 kernel"]


def test_crossover_at_the_auto_threshold_agrees_with_auto():
    bench = grid_rows(lambda d, k, p: {"kernel": 10.0, "batch_dma": 5.0 if k < 32 else 20.0}.get(p, 1.0))
    found = R.crossover(bench["results"])
    assert len(found) == 4 and all(c["dma_from_kib"] == 32 and c["agrees_with_auto"] for c in found)
    assert all(c["auto_worst"]["best_over_auto"] == 1.0 for c in found)


def test_a_crossover_above_the_threshold_is_reported_with_what_auto_loses():
    bench = grid_rows(lambda d, k, p: {"kernel": 10.0, "batch_dma": 5.0 if k <= 48 else 20.0}.get(p, 1.0))
    c = R.crossover(bench["results"])[0]
    assert c["dma_from_kib"] == 64 and not c["agrees_with_auto"]
    assert c["kernel_faster_at_kib"] == [2, 4, 8, 16, 24, 32, 48]
    assert c["auto_worst"] == {"block_kib": 32, "best_over_auto": 2.0}  # auto takes DMA at 32 and 48


def test_a_kernel_still_faster_at_the_threshold_disagrees_with_auto():
    bench = grid_rows(lambda d, k, p: {"kernel": 10.0, "batch_dma": 5.0 if k <= 32 else 20.0}.get(p, 1.0))
    c = R.crossover(bench["results"])[0]
    assert c["dma_from_kib"] == 48 and not c["agrees_with_auto"]  # auto takes DMA at 32, where it loses


def test_no_crossover_when_the_kernel_wins_at_the_largest_size():
    bench = grid_rows(lambda d, k, p: {"kernel": 30.0 if k == 1024 else 10.0, "batch_dma": 20.0}.get(p, 1.0))
    assert R.crossover(bench["results"])[0]["dma_from_kib"] is None


def steps_with(memcheck_errors=0, racecheck_errors=0, sanitizer="compute-sanitizer", skipped=0, status="ok"):
    junit = {"tests": 5, "failures": 0, "errors": 0, "skipped": skipped, "passed": 5 - skipped}
    return {
        s: {"status": status, "result": {"sanitizer": sanitizer, "sanitizer_errors": e, "junit": junit}}
        for s, e in (("memcheck", memcheck_errors), ("racecheck", racecheck_errors))
    }


def verdicts(bench, steps, dry=False):
    return {g["goal"]: g["verdict"] for g in R.judge_goals(bench, steps, dry)}


def test_every_goal_is_judged_pass_on_a_bench_that_meets_them():
    bench = grid_rows(lambda d, k, p: {"kernel": 50.0, "batch_dma": 5.0}.get(p, 1.0), vs=0.95)
    assert verdicts(bench, steps_with()) == {key: "pass" for key, _ in R.GOALS}


def test_each_goal_fails_where_its_number_falls_short():
    bench = grid_rows(lambda d, k, p: {"kernel": 20.0, "batch_dma": 5.0}.get(p, 1.0), vs=0.85)
    got = verdicts(bench, steps_with(racecheck_errors=2))
    assert got == {
        "dma_from_64k": "fail",
        "dma_at_16k": "pass",
        "kernel_at_2k": "fail",
        "sanitizers_clean": "fail",
    }
    judged = R.judge_goals(bench, steps_with(), False)
    assert judged[0]["measured"] == 0.85 and judged[2]["measured"] == 4.0


def test_a_row_that_failed_its_byte_check_is_not_judged():
    bench = grid_rows(lambda d, k, p: 1.0, vs=0.95)
    for r in bench["results"]:
        if r["path"] == "batch_dma" and r["block_kib"] == 16:
            r["ok"] = False
    assert verdicts(bench, steps_with())["dma_at_16k"] == "not measured"


def test_goals_without_measurements_are_not_measured():
    got = R.judge_goals(None, {}, False)
    assert [g["verdict"] for g in got] == ["not measured"] * len(R.GOALS)
    assert got[3]["why"] == "not run: memcheck, racecheck"


def test_the_sanitizer_goal_in_a_dry_run_is_not_measured():
    got = R.judge_goals(None, steps_with(sanitizer="not run (dry run: no GPU)", memcheck_errors=None), True)
    assert got[3]["verdict"] == "not measured" and got[3]["why"] == "no sanitizer in a dry run"
    assert "numbers mean nothing" in got[0]["note"]


def test_the_sanitizer_goal_fails_when_its_tests_skipped_or_it_printed_no_summary():
    assert verdicts(None, steps_with(skipped=1))["sanitizers_clean"] == "fail"
    assert verdicts(None, steps_with(memcheck_errors=None))["sanitizers_clean"] == "fail"
    assert verdicts(None, steps_with(status="timed out after 40s"))["sanitizers_clean"] == "fail"


def test_the_goals_are_the_ones_docs_performance_md_states():
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("## GPU (CUDA engine)")[1].split("\n## ")[0]
    bullets = [line[2:].rstrip(";.") for line in section.splitlines() if line.startswith("- ")]
    assert bullets == [text for _, text in R.GOALS]


def test_the_summary_names_the_second_shot_for_the_failed_steps(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    (run / "logs").mkdir(parents=True)
    out.mkdir()
    write(
        run / "meta.json",
        json.dumps(
            {
                "mode": "gpu",
                "all_steps": ["preflight", "build", "tests", "bench"],
                "steps_to_run": ["preflight", "build", "tests", "bench"],
            }
        ),
    )
    for step, status in (
        ("preflight", "ok"),
        ("build", "ok"),
        ("tests", "failed (exit 1)"),
        ("bench", "timed out after 45s"),
    ):
        write(run / "logs" / f"{step}.log", f"{step} output\n")
        assert R.record(str(run), str(out), step, status, 3, 10) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == ["tests", "bench"] and not summary["ok"]
    assert summary["second_shot"] == "bash scripts/gpu_check.sh --only build,tests,bench"
    assert summary["steps"][2]["result"]["log_tail"] == ["tests output"]
    assert summary["out_check"] == {"ok": True, "problems": [], "files": ["logs.tar.gz", "summary.json"]}


# --- nothing written in the tree -------------------------------------------------------------


def test_tree_writes_name_new_files_outside_the_build_outputs(tmp_path):
    since = time.time() - 1
    write(tmp_path / "torch_kvswap" / "_C.cpython-312-x86_64-linux-gnu.so")
    write(tmp_path / "tests" / "results.json")
    write(tmp_path / "docs" / "venv" / "pyvenv.cfg")  # not at the top: not a venv of a tool
    # other tools' folders, which CI's other lane writes in meanwhile
    write(tmp_path / "build" / "ci" / "steps.tsv")
    write(tmp_path / ".pytest_cache" / "v" / "cache" / "nodeids")
    write(tmp_path / "scripts" / "__pycache__" / "mutant_anchors.cpython-311.pyc")
    write(tmp_path / ".git" / "index")
    write(tmp_path / ".ci-cache" / "torch-2.10.0" / "x.h")
    write(tmp_path / ".venv-vllm" / "pyvenv.cfg")
    write(tmp_path / ".venv-vllm" / "bin" / "pip")
    assert R.tree_writes(str(tmp_path), since, R.BUILD_OUTPUTS) == [
        os.path.join("docs", "venv", "pyvenv.cfg"),
        os.path.join("tests", "results.json"),
    ]
    assert len(R.tree_writes(str(tmp_path), since, [])) == 3
    assert R.tree_writes(str(tmp_path), time.time() + 10, []) == []
    # a top-level folder without pyvenv.cfg is looked into
    write(tmp_path / ".venv-notes" / "x.txt")
    assert os.path.join(".venv-notes", "x.txt") in R.tree_writes(str(tmp_path), since, [])


# --- the script's arguments and budgets -----------------------------------------------------


def run_kit(*args, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=600
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "memcheck,nosuch"], "--only: unknown step 'nosuch' (expected some of: preflight build"),
        (["--only"], "--only needs a comma-separated list of steps"),
        (["--only", ""], "--only '': no step named"),
        (["--fast"], "unknown argument '--fast'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    got = run_kit("--dry-run", *args, OUT=str(tmp_path / "out"))
    assert got.returncode == 2 and message in got.stderr and "usage:" in got.stderr
    assert not (tmp_path / "out").exists()


def test_the_kit_refuses_to_run_without_out_on_a_gpu_machine():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    got = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert got.returncode == 2 and "OUT is not set" in got.stderr


def test_a_second_shot_runs_only_the_steps_named(tmp_path):
    pytest.importorskip("torch_kvswap._fake_cuda", reason="the fake CUDA runtime is not built")
    out = tmp_path / "out"
    got = run_kit("--dry-run", "--only", "report", OUT=str(out), PYTHON=sys.executable)
    assert got.returncode == 0, got.stdout + got.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["preflight", "report"]  # the build in the tree is reused
    assert summary["not_run"] == ["build", "tests", "probe", "bench", "memcheck", "racecheck"]
    assert summary["only"] == "report" and summary["ok"] and summary["out_check"]["ok"]
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.json"]
    assert [g["verdict"] for g in summary["goals"]] == ["not measured"] * len(R.GOALS)


def kit_summary(out):
    return json.loads((out / "summary.json").read_text())


def test_a_failed_preflight_stops_the_run_and_still_leaves_the_summary_and_logs(tmp_path):
    """A python without torch: the preflight fails, every other step is recorded as not run."""
    no_torch = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode != 0
    if not no_torch:
        pytest.skip("/usr/bin/python3 has torch here")
    out = tmp_path / "out"
    got = run_kit("--dry-run", OUT=str(out), PYTHON="/usr/bin/python3")
    assert got.returncode == 2 and "preflight failed" in got.stderr
    summary = kit_summary(out)
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status["preflight"] == "failed (exit 1)" and status["bench"] == "skipped: preflight failed"
    assert summary["failed"][0] == "preflight" and not summary["ok"] and summary["out_check"]["ok"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "ModuleNotFoundError" in tar.extractfile("preflight.log").read().decode()


def test_a_step_with_no_time_left_is_skipped(tmp_path):
    """A total of 1 s leaves the preflight less than 5 s after the guarded steps' slots."""
    out = tmp_path / "out"
    got = run_kit("--dry-run", OUT=str(out), KVSWAP_GPU_CHECK_SECONDS="1", KVSWAP_GPU_CHECK_SCALE="1")
    assert got.returncode == 2
    assert kit_summary(out)["steps"][0]["status"] == "skipped: out of time"


def test_an_out_that_is_not_a_writable_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    got = run_kit("--dry-run", OUT=str(tmp_path / "file"))
    assert got.returncode == 2 and "is not a writable directory" in got.stderr


def test_collected_names_the_tests_a_junit_run_lacks(tmp_path):
    xml = write(
        tmp_path / "m.xml",
        '<testsuites><testsuite tests="2">'
        '<testcase classname="tests.test_a" name="test_x[kernel-h2d]"/>'
        '<testcase classname="tests.test_a" name="test_y"/></testsuite></testsuites>',
    )
    assert R.collected(str(xml), ["tests/test_a.py::test_x[kernel-h2d]", "tests/test_a.py::test_y"]) == []
    assert R.collected(str(xml), ["tests/test_a.py::test_x[kernel-d2h]"]) == [
        "tests/test_a.py::test_x[kernel-d2h]"
    ]
    assert R.collected(str(tmp_path / "none.xml"), ["x"])[0].startswith(str(tmp_path / "none.xml"))
