"""The Ascend engine on a fake ACL runtime, in CPU CI.

The cases live in tests/fake_npu/cases_*.py. They need the fake 'npu'
PrivateUse1 backend, which is process-wide and becomes torch's accelerator
once loaded, so they run in child pytest sessions, one per case file, started
when a test here first needs it (a node id such as
``test_fake_npu[main-cases_cann-test_x]`` runs one file); each test here
reports one case function of a child session (all its parametrizations). The first run
builds the test extension into build/fake_npu/ (about a minute on two cores);
later runs reuse it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from torch_kvswap._build_shared import release

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).resolve().parent / "fake_npu"
LOAD_ABSENT = (
    "aclrtMemcpyBatchAsync,aclmdlRICaptureGetInfo,aclmdlRICaptureBegin,aclrtHostRegisterV2,"
    "aclrtPointerGetAttributes,aclGetRecentErrMsg"
)  # every optional ACL function
# session -> (case files, extra environment)
SESSIONS = {
    "main": (sorted(p for p in CASES.glob("cases_*.py") if p.name != "cases_load.py"), {}),
    "load": ([CASES / "cases_load.py"], {"KVSWAP_FAKE_ACL_ABSENT": LOAD_ABSENT}),
}

if release(torch.__version__)[:2] < (2, 13):
    pytest.skip("the Ascend engine targets the torch that torch_npu 2.13 pairs with", allow_module_level=True)


def case_functions() -> list[tuple[str, str, str]]:
    out = []
    for session, (files, _) in SESSIONS.items():
        for f in files:
            tree = ast.parse(f.read_text())
            out += [
                (session, f.stem, n.name)
                for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
            ]
    return out


def run_session(session: str, files: list[Path], tmp: Path) -> tuple[dict, str]:
    env = SESSIONS[session][1]
    xml = tmp / f"{session}-{files[0].stem}.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "python_files=cases_*.py",
            f"--junitxml={xml}",
            *map(str, files),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = proc.stdout + proc.stderr
    results: dict[tuple[str, str], list[tuple[str, str]]] = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            stem = case.get("classname", "").rsplit(".", 1)[-1]
            name = case.get("name", "")
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            verdict = (
                "passed" if problem is None else (problem.get("message", "") + "\n" + (problem.text or ""))
            )
            if case.find("skipped") is not None:
                verdict = "skipped: " + case.find("skipped").get("message", "")
            results.setdefault((stem, name.split("[")[0]), []).append((name, verdict))
    return results, output


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """(session, case module) -> that module's child session results, run once."""
    tmp = tmp_path_factory.mktemp("fake_npu")
    done: dict[tuple[str, str], tuple[dict, str]] = {}

    def results(session: str, module: str) -> tuple[dict, str]:
        if (session, module) not in done:
            done[(session, module)] = run_session(session, [CASES / f"{module}.py"], tmp)
        return done[(session, module)]

    return results


@pytest.mark.parametrize(
    "session,module,function", case_functions(), ids=lambda v: v if isinstance(v, str) else None
)
def test_fake_npu(child, session, module, function):
    results, output = child(session, module)
    runs = results.get((module, function))
    assert runs, f"{module}::{function} did not run in the child session:\n{output[-6000:]}"
    bad = [f"{name}: {verdict}" for name, verdict in runs if verdict != "passed"]
    assert not bad, "\n\n".join(bad)[-8000:]
