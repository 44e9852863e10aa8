"""setup.py's ``build_ext``: torch's BuildExtension, quiet, saying what it
will compile first (nothing when every extension is up to date), one line as
each extension starts and ends with its elapsed time, and one line per engine
last; it writes the build record ``torch_kvswap/_build_info.json``. Imports
torch's extension builder: setup.py imports this module only once it has
checked the torch it found."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ClassVar

import torch
from torch.utils.cpp_extension import BuildExtension

from . import flag, summary_lines
from .engines import FAKES_ENABLE, Engine

#: Rough compile times on this project's 2-vCPU machine, per engine (CUDA:
#: per architecture), from clean builds on 2026-11-30 and 2026-12-01: the host
#: engine's 8 files took 3-4 minutes at load averages of 4-12 and 9 at 17-19;
#: an install on torch 2.15 with the CUDA engine for 4 architectures took 8
#: minutes. More cores cut them; other work on the machine stretches them.
ROUGH_MINUTES = {"host": (2, 5), "cuda": (1, 2), "npu": (1, 2), "fake_cuda": (1, 3)}

#: The core's extension, which every other one links (BuildWithSummary.link_core).
CORE = "torch_kvswap._C"

LABELS = {
    "host": "host engine (_C)",
    "cuda": "CUDA engine (_C_cuda)",
    "npu": "Ascend engine (_C_npu)",
    "fake_cuda": "test fake (_fake_cuda)",
}


def plan_lines(
    torch_version: str, engines: list[Engine], selected: set[str], arch_list: str | None
) -> list[str]:
    """What the build is about to compile, each engine with a rough duration,
    printed before the compiler starts (the CUDA engine takes minutes per
    architecture). pip shows it with -v only."""
    low = high = 0
    lines = []
    for e in engines:
        if not (e.decision.build and e.module in selected):
            continue
        lo, hi = ROUGH_MINUTES[e.key]
        what = LABELS[e.key]
        if e.key == "cuda" and arch_list:
            n = len([a for a in arch_list.split(";") if a])
            lo, hi = lo * n, hi * n
            what += f" for {n} architecture(s), {arch_list}"
            if n > 1:
                what += " (TORCH_CUDA_ARCH_LIST=<your GPU's, e.g. 9.0> builds one)"
        elif e.key == "cuda":
            what += " for the visible GPU's architecture"
        lines.append(f"  {what}: about {lo}-{hi} min")
        low, high = low + lo, high + hi
    cpus = os.cpu_count() or 1
    return [
        f"torch_kvswap: building against torch {torch_version}; from scratch about {low}-{high} min on 2 "
        f"CPUs (this machine has {cpus}), a rebuild compiles only what changed:",
        *lines,
    ]


def is_stale(target: Path, sources: list[str]) -> bool:
    """Whether an extension file is older than its sources: it is missing, or
    a source or declared dependency is missing or newer (the rule of
    setuptools' ``newer_group``)."""
    if not target.exists():
        return True
    built = target.stat().st_mtime
    return any(not os.path.exists(s) or os.stat(s).st_mtime > built for s in sources)


def fingerprint(ext, torch_version: str) -> str:
    """What an extension's build depends on besides its files: the torch it
    compiles against, its sources and every flag (ninja would recompile on a
    changed command line; a skipped extension must not miss one)."""
    fields = [
        torch_version,
        os.environ.get("TORCH_CUDA_ARCH_LIST"),
        ext.sources,
        ext.depends,
        ext.include_dirs,
        ext.define_macros,
        ext.extra_compile_args,
        ext.extra_link_args,
        ext.libraries,
        ext.library_dirs,
    ]
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def elapsed(seconds: float) -> str:
    """A duration as a person reads it: '8.2 s', '3 min 05 s'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{int(seconds) // 60} min {int(seconds) % 60:02d} s"


def extension_files(package_dir: Path) -> list[Path]:
    """The compiled extension modules in a package folder."""
    return sorted(p for p in package_dir.iterdir() if p.suffix in (".so", ".pyd"))


def remove_stale_extensions(package_dir: Path, keep: set[str]) -> list[str]:
    """Deletes every extension file of `package_dir` whose name is not in
    `keep`; returns the names removed."""
    removed = []
    for path in extension_files(package_dir):
        if path.name not in keep:
            path.unlink()
            removed.append(path.name)
    if removed:
        print(
            f"torch_kvswap: left out of this build's output, not built by it: {', '.join(removed)}",
            file=sys.stderr,
        )
    return removed


@contextmanager
def captured_output(log_path: Path, verbose: bool):
    """Sends the build's stdout/stderr (compiler command lines included) to
    log_path; on failure prints the log's tail and where the whole log is.
    Yields the stream that still reaches the terminal, for progress lines.

    It redirects the file descriptors 1 and 2, not sys.stdout: the compilers
    run in ninja's child processes, which inherit the descriptors and write to
    them directly."""
    if verbose:
        yield sys.stderr
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    ok = False
    try:
        with open(log_path, "wb") as log, os.fdopen(os.dup(saved[1]), "w", buffering=1) as terminal:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield terminal
            ok = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        if not ok:
            tail = log_path.read_text(errors="replace").splitlines()[-120:]
            print("\n".join(tail), file=sys.stderr)
            print(
                f"torch_kvswap: build failed; the whole log is {log_path} "
                "(KVSWAP_VERBOSE_BUILD=1 shows it as it runs)",
                file=sys.stderr,
            )


class CompileProgress:
    """While one extension compiles, follows the build log from its current
    end and says each of ninja's "[done/all]" lines as "N of M files": a
    build is not silent for minutes. A context manager; the last lines are
    read when it ends."""

    STATUS = re.compile(rb"^\[(\d+)/(\d+)\] ", re.M)

    def __init__(self, log_path: Path, label: str, out, poll_s: float = 0.5):
        self.log_path, self.label, self.out, self.poll_s = log_path, label, out, poll_s
        self.offset = log_path.stat().st_size if log_path.exists() else 0
        self.pending = b""
        self.start = time.monotonic()
        self.stop = threading.Event()
        self.lock = threading.Lock()  # one reader at a time: each line is said once
        self.thread = threading.Thread(target=self._follow, name="kvswap-build-progress", daemon=True)

    def __enter__(self) -> CompileProgress:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.read()

    def _follow(self) -> None:
        while not self.stop.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        """Says every complete status line written since the last read."""
        with self.lock:
            self._read()

    def _read(self) -> None:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except OSError:
            return
        self.offset += len(chunk)
        text = self.pending + chunk
        complete, _, self.pending = text.rpartition(b"\n")
        for done, total in self.STATUS.findall(complete):
            print(
                f"torch_kvswap:   {self.label}: {int(done)} of {int(total)} files compiled "
                f"({elapsed(time.monotonic() - self.start)})",
                file=self.out,
                flush=True,
            )


class BuildWithSummary(BuildExtension):
    """torch's BuildExtension (ninja when found), quiet, ending with one line
    per engine."""

    #: Every engine with its decision, built or not; setup.py sets it before
    #: setup() runs the command.
    engines: ClassVar[list[Engine]] = []

    def finalize_options(self) -> None:
        keyed = self.build_temp is None  # not given with --build-temp
        super().finalize_options()
        if keyed:
            # Objects and fingerprints per torch release: a build for another
            # torch in the same clone (`pip install .` from another venv)
            # leaves this torch's in-place build as it was, with nothing to
            # compile again.
            self.build_temp = os.path.join(self.build_temp, f"torch-{torch.__version__}")

    def stale(self) -> list:
        """The extensions this run compiles. torch's BuildExtension forces
        setuptools to build every extension (ninja then recompiles what
        changed, but every one is linked anew); in place, an extension newer
        than its sources and built with the same fingerprint is skipped."""
        if not self.inplace:
            return list(self.extensions)
        try:
            in_place_torch = json.loads(self.record_path().read_text()).get("torch")
        except (OSError, ValueError):
            in_place_torch = None
        if in_place_torch != torch.__version__:
            return list(self.extensions)  # the tree's extensions are another torch's (or unknown)
        return [
            e
            for e in self.extensions
            if is_stale(Path(self.get_ext_fullpath(e.name)), [*e.sources, *e.depends])
            or not self.stamp(e).is_file()
            or self.stamp(e).read_text() != self.fingerprints[e.name]
        ]

    def stamp(self, ext) -> Path:
        """Where the fingerprint of an extension's last build is kept."""
        return Path(self.build_temp) / f"{ext.name}.fingerprint"

    def record_path(self) -> Path:
        """The build record, beside the core's extension: in the tree for an
        in-place build, in the build folder for a wheel."""
        return Path(self.get_ext_fullpath(CORE)).parent / "_build_info.json"

    def label(self, ext) -> str:
        return next((LABELS[e.key] for e in self.engines if e.module == ext.name), ext.name)

    def link_core(self, ext) -> None:
        """Every extension but the core links the core's library, for its
        engine registry (csrc/kvswap.h, kvswap_engine_registry), and finds
        it beside itself at run time: an engine installs itself when its
        library loads, imported or not. setuptools builds the core first;
        an in-place build that skips it links the tree's copy."""
        if ext.name == CORE or getattr(ext, "links_core", False):
            return
        core = Path(self.get_ext_fullpath(CORE))
        if not core.is_file():
            core = Path(__file__).resolve().parents[1] / "torch_kvswap" / core.name
        ext.extra_link_args = [
            *ext.extra_link_args,
            f"-L{core.parent}",
            f"-l:{core.name}",
            "-Wl,-rpath,$ORIGIN",
        ]
        ext.links_core = True

    def build_extension(self, ext):
        if ext not in self.to_build:
            return None  # up to date: not even linked anew
        self.link_core(ext)
        self.stamp(ext).unlink(missing_ok=True)
        label = self.label(ext)
        print(f"torch_kvswap: compiling the {label} ...", file=self.progress)
        start = time.monotonic()
        # An engine found by detection that does not compile is left out
        # (setuptools skips copying a missing optional extension); the
        # host engine and forced engines fail the build.
        progress = CompileProgress(self.log_path, label, self.progress) if self.log_path else nullcontext()
        try:
            with progress:
                super().build_extension(ext)
        except Exception as exc:  # reported in the summary
            print(
                f"torch_kvswap: the {label} failed after {elapsed(time.monotonic() - start)}",
                file=self.progress,
            )
            if not getattr(ext, "optional", False):
                raise
            self.failed[ext.name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            return
        self.stamp(ext).parent.mkdir(parents=True, exist_ok=True)
        self.stamp(ext).write_text(self.fingerprints[ext.name])
        print(
            f"torch_kvswap: the {label} compiled in {elapsed(time.monotonic() - start)}", file=self.progress
        )

    def copy_extensions_to_source(self) -> None:
        """In place, only what this run compiled is copied into the tree: a
        skipped extension is already there, and its copy in build/ may be
        gone (a wheel build drops the test fakes from build/)."""
        every = self.extensions
        self.extensions = [e for e in every if e in self.to_build]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every

    def opening_lines(self) -> list[str]:
        """What this run will compile with rough durations, or one line saying
        that nothing is stale (no banner for a rebuild that compiles nothing)."""
        if self.to_build:
            return plan_lines(
                torch.__version__,
                self.engines,
                {e.name for e in self.to_build},
                os.environ.get("TORCH_CUDA_ARCH_LIST"),
            )
        up_to_date = ", ".join(self.label(e) for e in self.extensions)
        return [
            f"torch_kvswap: nothing to compile, each extension is newer than its sources: {up_to_date} "
            f"(torch {torch.__version__})"
        ]

    def run(self):
        if not self.inplace:
            # Test-only fakes never go into a wheel or an installed tree.
            self.extensions = [e for e in self.extensions if not e.name.startswith("torch_kvswap._fake")]
            # An extension left in build/ by an earlier build, maybe for
            # another torch, looks up to date to setuptools: link anew
            # (ninja still recompiles only what changed).
            self.force = True
        built = {e.name for e in self.extensions}
        self.failed: dict[str, str] = {}  # extension name -> why it did not compile
        # Before torch's builder adds its flags to each extension.
        self.fingerprints = {e.name: fingerprint(e, torch.__version__) for e in self.extensions}
        self.to_build = self.stale()
        print("\n".join(self.opening_lines()), file=sys.stderr, flush=True)
        log = Path(tempfile.mkstemp(prefix="torch_kvswap-build-", suffix=".log")[1])
        verbose = bool(flag("KVSWAP_VERBOSE_BUILD"))
        self.log_path = None if verbose else log  # verbose: ninja's own lines reach the terminal
        with captured_output(log, verbose) as self.progress:
            super().run()
        warnings = (
            [line for line in log.read_text(errors="replace").splitlines() if "warning:" in line]
            if log.exists()
            else []
        )
        record = self.record_path()
        if not self.inplace:
            # Only what this build built goes into the wheel: an extension
            # file in the build folder that this build did not write (a
            # test fake built in place and copied with the package's
            # files, or an engine of an earlier build) is removed.
            remove_stale_extensions(
                record.parent,
                {
                    Path(self.get_ext_fullpath(e.name)).name
                    for e in self.extensions
                    if e.name not in self.failed
                },
            )
        info = self.build_info(built)
        record.write_text(json.dumps(info, indent=2) + "\n")
        if self.to_build:
            for line in summary_lines(info):
                print(line, file=sys.stderr)
        if warnings or self.failed:
            print(
                f"torch_kvswap: {len(warnings)} compiler warning(s); the whole build log is {log}",
                file=sys.stderr,
            )
        else:
            log.unlink(missing_ok=True)

    def build_info(self, selected: set[str]) -> dict:
        out = {
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
            "engines": {},
        }
        for e in self.engines:
            out["engines"][e.key] = self.engine_entry(e, selected)
        return out

    def engine_entry(self, e: Engine, selected: set[str]) -> dict:
        entry = {"module": e.module, "built": False, "test_only": e.test_only}
        if e.decision.build and e.module in selected:
            if e.module not in self.failed:
                # The file this record describes, so the record and what is
                # installed cannot disagree.
                path = Path(self.get_ext_fullpath(e.module))
                entry["built"] = path.is_file()
                entry["file"] = path.name
                if not path.is_file():
                    entry["reason"] = f"the build wrote no {path.name}"
                    entry["enable"] = "rebuild with KVSWAP_VERBOSE_BUILD=1 and read the log"
            else:
                entry["reason"] = f"detected, but it failed to compile ({self.failed[e.module]})"
                entry["enable"] = f"fix that error, or set KVSWAP_BUILD_{e.key.upper()}=0"
        elif e.decision.build:
            entry["reason"] = "test-only; built only in place, never into a wheel"
            entry["enable"] = FAKES_ENABLE
        else:
            entry["reason"], entry["enable"] = e.decision.reason, e.decision.enable
        return entry
