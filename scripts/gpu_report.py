"""The GPU kit's bookkeeping, run by scripts/gpu_check.sh after every step; imports no torch.

    python scripts/gpu_report.py record RUN OUT STEP STATUS SECONDS BUDGET [--final]
    python scripts/gpu_report.py judge RUN OUT
    python scripts/gpu_report.py collected JUNIT.xml NODE_ID...

``record`` adds one step's record (with what its logs and JSON say) to
RUN/steps.jsonl, rewrites OUT/summary.json from it, packs RUN/logs into
OUT/logs.tar.gz (each log cut to fit), and checks OUT against the device
machine's rules (what comes back from it). With ``--final`` it also checks
that every step that ran left its record and JSON, and that nothing was
written into the tree outside the build's outputs; it exits 1 when a check
fails. ``judge`` checks the probe and bench results and judges
docs/performance.md's GPU goals (RUN/judged.json), exit 1 when a result
failed its check or is missing. ``collected`` says whether a pytest run's
junit XML holds every test named (a dry run's racecheck: its tests are among
memcheck's).

RUN is the run's own folder under /tmp (logs, junit XML, sanitizer logs);
OUT is what comes back. The rules, the bench grid and the goals live here so
that tests/test_gpu_kit.py can check them without torch or a GPU.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
import time
import xml.etree.ElementTree as ET

# --- what comes back from the device machine ----------------------------------------------

MAX_FILES = 6  # the device returns 8; two are left free
MAX_FILE_BYTES = 16 << 20
MAX_TOTAL_BYTES = 64 << 20
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
LOG_CUT_BYTES = 1 << 20  # per log inside logs.tar.gz: the head and the tail
LOG_HEAD_BYTES = 128 << 10

# --- the bench grid (scripts/gpu_bench.py measures it, judge checks it is complete) -------

DIRECTIONS = ("h2d", "d2h")
BLOCK_KIB = (2, 4, 8, 16, 24, 32, 48, 64, 256, 1024)
DESCRIPTORS = (256, 4096)
PATHS = ("contiguous", "batch_dma", "kernel", "per_copy")
D2D_KIB = 16
AUTO_THRESHOLD_KIB = 32  # set_copy_method("auto"): the kernel below, DMA from here

# docs/performance.md, "GPU (CUDA engine)": one entry per goal there (text as written there).
GOALS = (
    ("dma_from_64k", "batch DMA ≥ 0.9× the contiguous pinned copy from 64 KiB"),
    ("dma_at_16k", "batch DMA ≥ 0.8× the contiguous pinned copy at 16 KiB"),
    ("kernel_at_2k", "the kernel path at 2 KiB ≥ 5× batch DMA"),
    (
        "sanitizers_clean",
        "compute-sanitizer memcheck (kernel and batch paths) and racecheck (kernel path) find nothing",
    ),
)


def check_out(out: str, required=()) -> tuple[list[str], list[str]]:
    """Problems with folder `out` under the device's rules, and the files it holds."""
    problems, files, total = [], [], 0
    for dirpath, dirnames, filenames in os.walk(out):
        rel = os.path.relpath(dirpath, out)
        for d in sorted(dirnames):
            problems.append(
                f"{os.path.join(rel, d) if rel != '.' else d}: a folder (only files at the top level)"
            )
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            name = f if rel == "." else os.path.join(rel, f)
            files.append(name)
            if not NAME.match(f):
                problems.append(f"{name}: name has characters other than letters, digits, '.', '_', '-'")
            if os.path.islink(path) or not os.path.isfile(path):
                problems.append(f"{name}: not a plain file")
                continue
            size = os.path.getsize(path)
            total += size
            if size > MAX_FILE_BYTES:
                problems.append(f"{name}: {size} bytes, over {MAX_FILE_BYTES}")
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files, at most {MAX_FILES} allowed: {', '.join(files)}")
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes in all, over {MAX_TOTAL_BYTES}")
    for name in required:
        path = os.path.join(out, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: missing")
        elif name.endswith(".json"):
            try:
                with open(path) as f:
                    json.load(f)
            except ValueError as exc:
                problems.append(f"{name}: not valid JSON ({exc})")
    return problems, files


def cut(data: bytes, limit: int = LOG_CUT_BYTES, head: int = LOG_HEAD_BYTES) -> bytes:
    """`data` within `limit` bytes: its head, a note of what was cut, and its tail."""
    if len(data) <= limit:
        return data
    note = f"\n[... {len(data) - limit} bytes cut by gpu_report.py ...]\n".encode()
    return data[:head] + note + data[len(data) - (limit - head) :]


def pack_logs(logs: str, target: str) -> None:
    """Every file in `logs` (cut to fit) into one gzip tarball `target`, replaced atomically."""
    part = target + ".part"
    with tarfile.open(part, "w:gz") as tar:
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            path = os.path.join(logs, name)
            if not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data = cut(f.read())
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(os.path.getmtime(path))
            tar.addfile(info, io.BytesIO(data))
    os.replace(part, target)


# --- what each step's logs say ------------------------------------------------------------


def junit_counts(path: str) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


SANITIZER_SUMMARY = re.compile(r"(ERROR|RACECHECK) SUMMARY: (\d+) (?:errors?|hazards?)")


def sanitizer_errors(text: str) -> int | None:
    """Errors compute-sanitizer reported (its last summary line), None when it printed none.
    memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed
    (E errors, W warnings)", of which the errors count."""
    last = None
    for line in text.splitlines():
        m = SANITIZER_SUMMARY.search(line)
        if not m:
            continue
        if m.group(1) == "RACECHECK":
            e = re.search(r"\((\d+) errors?", line)
            last = int(e.group(1)) if e else int(m.group(2))
        else:
            last = int(m.group(2))
    return last


def read_text(path: str, limit: int = 4000) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return None


def step_result(run: str, out: str, step: str) -> dict:
    """What a step left behind, as JSON: every step has one (the final check asks)."""
    logs = os.path.join(run, "logs")
    log = read_text(os.path.join(logs, f"{step}.log")) or ""
    tail = log.strip().splitlines()[-6:]
    result: dict = {"log": f"logs.tar.gz:{step}.log", "log_tail": tail}
    if step == "preflight":
        result["lines"] = log.strip().splitlines()[:8]
    counts = junit_counts(os.path.join(logs, f"{step}.xml"))
    if counts is not None:
        result["junit"] = counts
    if step in ("memcheck", "racecheck"):
        text = read_text(os.path.join(logs, f"{step}-sanitizer.txt"), limit=1 << 20)
        result["sanitizer"] = "not run (dry run: no GPU)" if text is None else "compute-sanitizer"
        result["sanitizer_errors"] = None if text is None else sanitizer_errors(text)
    if step in ("probe", "bench"):
        try:
            with open(os.path.join(out, f"{step}.json")) as f:
                data = json.load(f)
            rows = data.get("results", [])
            result["results"] = len(rows)
            result["results_ok"] = sum(1 for r in rows if r.get("ok"))
            if step == "bench":
                result["crossover"] = data.get("crossover")
        except (OSError, ValueError) as exc:
            result["error"] = f"{step}.json: {exc}"
    if step == "report":
        try:
            with open(os.path.join(run, "judged.json")) as f:
                result["judged"] = True
                result["problems"] = json.load(f).get("problems", [])
        except (OSError, ValueError) as exc:
            result["judged"] = False
            result["error"] = str(exc)
    return result


# --- goals and crossover ------------------------------------------------------------------


def rows_of(bench: dict, **want) -> list[dict]:
    return [r for r in bench.get("results", []) if all(r.get(k) == v for k, v in want.items())]


def missing_rows(bench: dict) -> list[str]:
    """Grid points of the bench with no result: every size and path, both directions and
    descriptor counts, and device-to-device at 16 KiB."""
    have = {
        (r.get("direction"), r.get("block_kib"), r.get("descriptors_asked"), r.get("path"))
        for r in bench.get("results", [])
    }
    want = [(d, k, n, p) for d in DIRECTIONS for k in BLOCK_KIB for n in DESCRIPTORS for p in PATHS]
    want += [("d2d", D2D_KIB, n, p) for n in DESCRIPTORS for p in PATHS]
    return [f"{d} {k} KiB x {n} {p}" for d, k, n, p in want if (d, k, n, p) not in have]


def crossover(rows: list[dict]) -> list[dict]:
    """Per direction and descriptor count: the smallest block size from which batch DMA is at
    least as fast as the kernel at every larger size measured, and what set_copy_method("auto")
    (kernel below 32 KiB, DMA from 32 KiB) loses against the faster path at its worst size."""
    found = []
    for d in DIRECTIONS + ("d2d",):
        for n in DESCRIPTORS:
            gb = {}
            for r in rows:
                if (
                    r.get("direction") == d
                    and r.get("descriptors_asked") == n
                    and r.get("ok")
                    and r.get("path") in ("batch_dma", "kernel")
                    and r.get("gbps")
                ):
                    gb.setdefault(r["block_kib"], {})[r["path"]] = r["gbps"]
            sizes = sorted(k for k, v in gb.items() if len(v) == 2)
            if d == "d2d" or not sizes:
                continue
            dma_from = None
            for k in reversed(sizes):
                if gb[k]["batch_dma"] >= gb[k]["kernel"]:
                    dma_from = k
                else:
                    break
            worst = None
            for k in sizes:
                auto = gb[k]["kernel" if k < AUTO_THRESHOLD_KIB else "batch_dma"]
                loss = max(gb[k].values()) / auto
                if worst is None or loss > worst["best_over_auto"]:
                    worst = {"block_kib": k, "best_over_auto": round(loss, 3)}
            kernel_faster = [k for k in sizes if gb[k]["kernel"] > gb[k]["batch_dma"]]
            found.append(
                {
                    "direction": d,
                    "descriptors": n,
                    "dma_from_kib": dma_from,  # None: the kernel is faster at the largest size
                    "kernel_faster_at_kib": kernel_faster,
                    "auto_threshold_kib": AUTO_THRESHOLD_KIB,
                    "agrees_with_auto": dma_from is not None
                    and max([k for k in sizes if k < dma_from], default=0) < AUTO_THRESHOLD_KIB <= dma_from,
                    "auto_worst": worst,
                }
            )
    return found


def judge_goals(bench: dict | None, steps: dict, dry: bool) -> list[dict]:
    """Each goal of docs/performance.md: pass, fail, or not measured (and why)."""
    note = "fake runtime: the judging code ran, the numbers mean nothing" if dry else None
    judged = []

    def ratio_goal(key, text, kib_ok, target):
        rows = [
            r
            for r in (bench or {}).get("results", [])
            if r.get("path") == "batch_dma"
            and r.get("direction") in DIRECTIONS
            and kib_ok(r.get("block_kib"))
            and r.get("ok")
        ]
        vals = [(r.get("vs_contiguous"), r) for r in rows]
        if not rows or any(v is None for v, _ in vals):
            return {"goal": key, "text": text, "verdict": "not measured", "why": "no checked bench row"}
        v, r = min(vals, key=lambda x: x[0])
        return {
            "goal": key,
            "text": text,
            "target": target,
            "measured": round(v, 3),
            "worst_at": f"{r['direction']} {r['block_kib']} KiB x {r['descriptors']}",
            "verdict": "pass" if v >= target else "fail",
        }

    for key, text in GOALS:
        if key == "dma_from_64k":
            g = ratio_goal(key, text, lambda k: k is not None and k >= 64, 0.9)
        elif key == "dma_at_16k":
            g = ratio_goal(key, text, lambda k: k == 16, 0.8)
        elif key == "kernel_at_2k":
            pairs = []
            for d in DIRECTIONS:
                for n in DESCRIPTORS:
                    k = rows_of(bench or {}, direction=d, block_kib=2, descriptors_asked=n, path="kernel")
                    b = rows_of(bench or {}, direction=d, block_kib=2, descriptors_asked=n, path="batch_dma")
                    if (
                        k
                        and b
                        and k[0].get("ok")
                        and b[0].get("ok")
                        and k[0].get("gbps")
                        and b[0].get("gbps")
                    ):
                        pairs.append((k[0]["gbps"] / b[0]["gbps"], f"{d} x {n}"))
            if len(pairs) < len(DIRECTIONS) * len(DESCRIPTORS):
                g = {
                    "goal": key,
                    "text": text,
                    "verdict": "not measured",
                    "why": "no checked 2 KiB kernel and DMA rows",
                }
            else:
                v, where = min(pairs)
                g = {
                    "goal": key,
                    "text": text,
                    "target": 5.0,
                    "measured": round(v, 3),
                    "worst_at": where,
                    "verdict": "pass" if v >= 5.0 else "fail",
                }
        else:  # sanitizers_clean
            found = {s: steps.get(s, {}) for s in ("memcheck", "racecheck")}
            errors = {s: r.get("result", {}).get("sanitizer_errors") for s, r in found.items()}
            if any(not r for r in found.values()):
                g = {
                    "goal": key,
                    "text": text,
                    "verdict": "not measured",
                    "why": "not run: " + ", ".join(s for s, r in found.items() if not r),
                }
            elif any(r.get("result", {}).get("sanitizer") != "compute-sanitizer" for r in found.values()):
                g = {"goal": key, "text": text, "verdict": "not measured", "why": "no sanitizer in a dry run"}
            elif any(e is None for e in errors.values()):
                g = {
                    "goal": key,
                    "text": text,
                    "verdict": "fail",
                    "measured": errors,
                    "why": "a sanitizer printed no summary (cut short?)",
                }
            else:
                junit = {s: r.get("result", {}).get("junit") or {} for s, r in found.items()}
                unrun = [s for s, j in junit.items() if not j.get("passed") or j.get("skipped")]
                clean = all(e == 0 for e in errors.values()) and all(
                    r.get("status") == "ok" for r in found.values()
                )
                g = {
                    "goal": key,
                    "text": text,
                    "measured": errors,
                    "tests": junit,
                    "verdict": "pass" if clean and not unrun else "fail",
                }
                if unrun:
                    g["why"] = "the chosen tests did not all run under: " + ", ".join(unrun)
        if note:
            g["note"] = note
        judged.append(g)
    return judged


def result_problems(out: str, ran: list[str]) -> list[str]:
    """Probe and bench results that failed their checks, and bench grid points with no row."""
    bad = []
    for name in ("probe", "bench"):
        if name not in ran:
            continue
        try:
            with open(os.path.join(out, f"{name}.json")) as f:
                data = json.load(f)
            results = data["results"]
        except (OSError, ValueError, KeyError) as exc:
            bad.append(f"{name}.json: {exc}")
            continue
        if not results:
            bad.append(f"{name}.json: no results")
        bad += [f"{name}: {json.dumps(r)[:300]}" for r in results if not r.get("ok")]
        if name == "probe":
            for r in results:
                if r.get("case", [None])[0] == "reduce_overhead" and "graph_recorded" not in r:
                    bad.append(f"probe {r['case']}: no graph_recorded report")
        else:
            bad += [f"bench: no row for {m}" for m in missing_rows(data)]
    return bad


# --- the summary --------------------------------------------------------------------------


def load_steps(run: str) -> list[dict]:
    try:
        with open(os.path.join(run, "steps.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def load_meta(run: str) -> dict:
    try:
        with open(os.path.join(run, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


#: top-level folders of other tools, which CI's other lane writes in while the kit
#: runs (.ci/run): git's, the build area (the kit's own build writes there too), the
#: engine checks' header cache and pytest's cache; every virtual environment and
#: every __pycache__ (Python's bytecode of whoever imports first) are skipped as well
OTHER_TOOLS = (".git", "build", ".ci-cache", ".pytest_cache")


def tree_writes(root: str, since: float, allowed: list[str]) -> list[str]:
    """Files under `root` changed after `since`, outside `allowed` prefixes
    (the build's in-place outputs), not counting OTHER_TOOLS' folders or a
    virtual environment (a top-level folder holding pyvenv.cfg)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if rel == ".":
            dirnames[:] = [
                d
                for d in dirnames
                if d not in OTHER_TOOLS and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))
            ]
        for f in filenames:
            path = os.path.join(dirpath, f)
            name = os.path.normpath(os.path.join(rel, f))
            try:
                changed = os.lstat(path).st_mtime > since
            except OSError:
                continue
            if changed and not any(re.fullmatch(a, name) for a in allowed):
                found.append(name)
    return sorted(found)


BUILD_OUTPUTS = [r"torch_kvswap/_[A-Za-z0-9_]+\..*so", r"torch_kvswap/_build_info\.json"]


def write_summary(run: str, out: str, final: bool) -> int:
    meta, steps = load_meta(run), load_steps(run)
    by_step = {s["step"]: s for s in steps}
    ran = [s["step"] for s in steps]
    summary = {
        "kit": "scripts/gpu_check.sh",
        "mode": meta.get("mode"),
        "started": meta.get("started"),
        "budget_total_s": meta.get("total"),
        "only": meta.get("only"),
        "steps": steps,
        "not_run": [s for s in meta.get("all_steps", []) if s not in ran],
    }
    try:
        with open(os.path.join(run, "judged.json")) as f:
            judged = json.load(f)
        summary["goals"] = judged.get("goals")
        summary["result_problems"] = judged.get("problems")
    except (OSError, ValueError):
        pass
    failed = [s for s in ran if by_step[s]["status"] != "ok" and s not in ("report",)]
    summary["failed"] = failed
    # The build goes first: ninja rebuilds only what a fix changed (nothing on a warm
    # machine without one), and a fresh machine needs it anyway.
    again = ["build"] + [s for s in failed if s not in ("build", "preflight")]
    summary["second_shot"] = f"bash scripts/gpu_check.sh --only {','.join(again)}" if failed else None
    problems: list[str] = []
    if final:
        for s in meta.get("steps_to_run", []):
            if s not in by_step:
                problems.append(f"step {s}: no record")
            elif not by_step[s].get("result"):
                problems.append(f"step {s}: no result")
        writes = tree_writes(
            meta.get("root", "."),
            meta.get("started_epoch", time.time()),
            BUILD_OUTPUTS if "build" in ran else [],
        )
        summary["tree_writes"] = writes
        problems += [f"written in the tree: {w}" for w in writes[:20]]
    started = [s for s in ran if not by_step[s]["status"].startswith("skipped")]
    required = ["summary.json", "logs.tar.gz"] + [f"{s}.json" for s in ("probe", "bench") if s in started]
    for _ in range(2):  # the check sees the summary it is written into
        summary["out_check"] = {"ok": None, "problems": [], "files": []}
        tmp = os.path.join(run, "summary.json")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        out_problems, files = check_out(out, required if final else ())
        summary["out_check"] = {"ok": not out_problems, "problems": out_problems, "files": files}
        all_problems = problems + out_problems
        summary["kit_problems"] = all_problems
        summary["ok"] = (
            not failed
            and not all_problems
            and bool(steps)
            and by_step.get("report", {}).get("status", "ok") == "ok"
        )
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    for p in problems + summary["out_check"]["problems"]:
        print(f"gpu_report: {p}", file=sys.stderr)
    return 1 if final and (problems or summary["out_check"]["problems"]) else 0


def record(run, out, step, status, seconds, budget, final=False) -> int:
    entry = {
        "step": step,
        "status": status,
        "seconds": int(seconds),
        "budget": int(budget),
        "result": step_result(run, out, step),
    }
    with open(os.path.join(run, "steps.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")
    pack_logs(os.path.join(run, "logs"), os.path.join(out, "logs.tar.gz"))
    return write_summary(run, out, final)


def judge(run: str, out: str) -> int:
    meta, steps = load_meta(run), load_steps(run)
    ran = [s["step"] for s in steps]
    bench = None
    if "bench" in ran:
        try:
            with open(os.path.join(out, "bench.json")) as f:
                bench = json.load(f)
        except (OSError, ValueError):
            bench = None
    goals = judge_goals(bench, {s["step"]: s for s in steps}, meta.get("mode") == "dry")
    problems = result_problems(out, ran)
    with open(os.path.join(run, "judged.json"), "w") as f:
        json.dump({"goals": goals, "problems": problems}, f, indent=1)
    for g in goals:
        print(f"goal {g['goal']}: {g['verdict']} {g.get('measured', '')} {g.get('why', '')}".rstrip())
    print("\n".join(problems) if problems else "every result checked")
    return 1 if problems else 0


def collected(junit: str, node_ids: list[str]) -> list[str]:
    """The node ids (path::name[params]) that a pytest run's junit XML holds no test case of."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as exc:
        return [f"{junit}: {exc}"]
    have = {c.get("name") for c in root.iter("testcase")}
    return [n for n in node_ids if n.rpartition("::")[2] not in have]


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "collected":
        missing = collected(argv[2], argv[3:])
        print(
            "\n".join(f"not collected: {m}" for m in missing)
            or f"{len(argv) - 3} of {len(argv) - 3} tests collected by that run"
        )
        return 1 if missing else 0
    if len(argv) >= 8 and argv[1] == "record":
        return record(*argv[2:8], final="--final" in argv[8:])
    if len(argv) == 4 and argv[1] == "judge":
        return judge(argv[2], argv[3])
    print(
        "usage: gpu_report.py record RUN OUT STEP STATUS SECONDS BUDGET [--final] | judge RUN OUT",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
