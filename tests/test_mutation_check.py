"""The mutation check's own logic: loading mutants, catching stale ones, reading pytest's verdict."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mc = importlib.util.module_from_spec(_spec)
sys.modules["mutation_check"] = mc  # dataclasses look their module up there
_spec.loader.exec_module(mc)

GOOD = '''MUTANTS = [dict(name="a", file="pkg/x.py", find="return 1", replace="return 2",
                tests=["tests/test_x.py"], why="wrong value")]
'''


def test_every_mutant_file_of_the_repository_loads_and_is_current():
    mutants, problems = mc.load_mutants()
    assert problems == []
    assert len({m.name for m in mutants}) == len(mutants) >= 25
    assert mc.check_against_tree(mutants, ROOT) == []


def test_mutants_are_loaded_from_every_file(tmp_path):
    (tmp_path / "core.py").write_text(GOOD)
    (tmp_path / "handler.py").write_text(GOOD.replace('name="a"', 'name="b"'))
    (tmp_path / "_helpers.py").write_text("raise RuntimeError('not a mutant file')")
    mutants, problems = mc.load_mutants(tmp_path)
    assert problems == []
    assert [(m.name, m.source) for m in mutants] == [("a", "core.py"), ("b", "handler.py")]
    assert not mutants[0].needs_build


def test_malformed_mutant_files_are_reported(tmp_path):
    (tmp_path / "a.py").write_text(GOOD)
    (tmp_path / "b.py").write_text(GOOD)  # the same name again
    (tmp_path / "c.py").write_text('MUTANTS = [dict(name="c", file="x.cpp", find="x")]')
    (tmp_path / "d.py").write_text("NOTHING = 1")
    (tmp_path / "e.py").write_text("syntax error here")
    _, problems = mc.load_mutants(tmp_path)
    text = "\n".join(problems)
    assert "name 'a' is also used in a.py" in text
    assert "missing ['replace', 'tests', 'why']" in text
    assert "d.py: defines no MUTANTS list" in text
    assert "e.py: cannot be loaded" in text


def test_stale_mutants_are_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    (tmp_path / "pkg" / "x.py").write_text("return 1\nreturn 1\n")
    mutant = mc.Mutant(name="a", file="pkg/x.py", find="return 1", replace="return 2",
                       tests=["tests/test_x.py", "tests/test_gone.py::t"], why="", source="core.py")
    problems = mc.check_against_tree([mutant], tmp_path)
    assert "a: its find snippet occurs 2 times in pkg/x.py (must be exactly once); update the mutant" in problems
    assert "a: test tests/test_gone.py::t does not exist" in problems
    (tmp_path / "pkg" / "x.py").write_text("return 3\n")
    assert "a: its find snippet occurs 0 times" in mc.check_against_tree([mutant], tmp_path)[0]


def test_the_killing_test_is_the_first_failure():
    out = ("..F\nFAILED tests/test_a.py::test_one[2] - AssertionError\n"
           "FAILED tests/test_a.py::test_two\n1 failed")
    assert mc.verdict(1, out, 60) == ("killed", "tests/test_a.py::test_one[2]")
    assert mc.verdict(2, "ERROR tests/test_b.py - ImportError", 60) == ("killed", "tests/test_b.py")
    assert mc.verdict(0, "5 passed", 60) == ("survived", "every test passed")
    assert mc.verdict("timeout", "", 60)[0] == "killed"
    assert mc.verdict(-11, 'File "/x/tests/test_c.py", line 9 in test_three', 60) == (
        "killed", "crash: pytest died of signal 11 in tests/test_c.py::test_three")
    assert mc.verdict(4, "ERROR: file or directory not found", 60)[0] == "error"
    assert mc.verdict(5, "no tests ran", 60)[0] == "error"
