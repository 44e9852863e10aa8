"""setup.py's ``build_ext``: torch's BuildExtension, quiet, saying what it
will compile first and one line per engine last, and writing the build record
``torch_kvswap/_build_info.json``. Imports torch's extension builder: setup.py
imports this module only once it has checked the torch it found."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
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


def plan_lines(torch_version: str, engines: list[Engine], selected: set[str], arch_list: str | None) -> list[str]:
    """What the build is about to compile, each engine with a rough duration,
    printed before the compiler starts (the CUDA engine takes minutes per
    architecture). pip shows it with -v only."""
    names = {"host": "host engine (_C)", "cuda": "CUDA engine (_C_cuda)", "npu": "Ascend engine (_C_npu)",
             "fake_cuda": "test fake (_fake_cuda)"}
    low = high = 0
    lines = []
    for e in engines:
        if not (e.decision.build and e.module in selected):
            continue
        lo, hi = ROUGH_MINUTES[e.key]
        what = names[e.key]
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
    return [f"torch_kvswap: building against torch {torch_version}; from scratch about {low}-{high} min on 2 "
            f"CPUs (this machine has {cpus}), a rebuild compiles only what changed:", *lines]


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
        print(f"torch_kvswap: left out of this build's output, not built by it: {', '.join(removed)}",
              file=sys.stderr)
    return removed


@contextmanager
def captured_output(log_path: Path, verbose: bool):
    """Sends the build's stdout/stderr (compiler command lines included) to
    log_path; on failure prints the log's tail and where the whole log is.

    It redirects the file descriptors 1 and 2, not sys.stdout: the compilers
    run in ninja's child processes, which inherit the descriptors and write to
    them directly."""
    if verbose:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    ok = False
    try:
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
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
            print(f"torch_kvswap: build failed; the whole log is {log_path} "
                  "(KVSWAP_VERBOSE_BUILD=1 shows it as it runs)", file=sys.stderr)


class BuildWithSummary(BuildExtension):
    """torch's BuildExtension (ninja when found), quiet, ending with one line
    per engine."""

    #: Every engine with its decision, built or not; setup.py sets it before
    #: setup() runs the command.
    engines: ClassVar[list[Engine]] = []

    def build_extension(self, ext):
        # An engine found by detection that does not compile is left out
        # (setuptools skips copying a missing optional extension); the
        # host engine and forced engines fail the build.
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            if not getattr(ext, "optional", False):
                raise
            self.failed[ext.name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

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
        for line in plan_lines(torch.__version__, self.engines, built, os.environ.get("TORCH_CUDA_ARCH_LIST")):
            print(line, file=sys.stderr, flush=True)
        log = Path(tempfile.mkstemp(prefix="torch_kvswap-build-", suffix=".log")[1])
        with captured_output(log, bool(flag("KVSWAP_VERBOSE_BUILD"))):
            super().run()
        warnings = [line for line in log.read_text(errors="replace").splitlines()
                    if "warning:" in line] if log.exists() else []
        package_dir = Path(self.get_ext_fullpath("torch_kvswap._C")).parent
        if not self.inplace:
            # Only what this build built goes into the wheel: an extension
            # file in the build folder that this build did not write (a
            # test fake built in place and copied with the package's
            # files, or an engine of an earlier build) is removed.
            remove_stale_extensions(package_dir, {Path(self.get_ext_fullpath(e.name)).name
                                                  for e in self.extensions if e.name not in self.failed})
        info = self.build_info(built)
        (package_dir / "_build_info.json").write_text(json.dumps(info, indent=2) + "\n")
        for line in summary_lines(info):
            print(line, file=sys.stderr)
        if warnings or self.failed:
            print(f"torch_kvswap: {len(warnings)} compiler warning(s); the whole build log is {log}",
                  file=sys.stderr)
        else:
            log.unlink(missing_ok=True)

    def build_info(self, selected: set[str]) -> dict:
        out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"), "engines": {}}
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
