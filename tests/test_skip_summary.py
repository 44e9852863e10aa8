"""The suite's end of run: skip reasons grouped and counted (tests/conftest.py),
and no `s` per skipped test in the progress line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CASES = '''
import pytest

@pytest.mark.parametrize("i", range(3))
def test_needs_a_gpu(i):
    pytest.skip("no CUDA device")

def test_needs_an_npu():
    pytest.skip("no NPU device")

@pytest.mark.skip(reason="marked off")
def test_marked():
    pass

def test_runs():
    assert True

@pytest.mark.xfail(reason="known bug")
def test_known_bug():
    assert False
'''


def test_the_run_ends_with_each_skip_reason_once_with_its_count(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    start = lines.index(next(x for x in lines if "skip reasons" in x))
    # Most frequent first, then by reason; an xfail is not a skip.
    assert lines[start + 1 : start + 4] == [
        "3 skipped: no CUDA device",
        "1 skipped: marked off",
        "1 skipped: no NPU device",
    ], proc.stdout
    assert "known bug" not in "\n".join(lines[start : start + 4])
    # The progress line holds the pass and the xfail, no `s`.
    assert lines[0].startswith(".x ") or lines[0].split()[0] == ".x", proc.stdout
    assert "1 passed, 5 skipped, 1 xfailed" in proc.stdout
