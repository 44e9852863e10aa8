"""Where a mutant applies: its definition (``where``) and its snippet (``find``).

A mutant names the definition that holds its snippet: a Python function,
method or class (``KVCacheOffloader._plan``, ``_as_ids``) or a C++ function,
class or macro block (``swap_blocks_batch``, ``kvswap::core::check_pointer_batch``).
A name matches a definition whose qualified name is the name or ends with it
(``_plan`` matches ``KVCacheOffloader._plan``). The definition is looked for
in the mutant's ``file`` first; when that file is gone or does not define it,
in every product file of the same language (``SEARCHED``), so a renamed file
or a function moved to another file still resolves. Without ``where`` (or with
``"<module>"``) the snippet is looked for in the whole ``file``.

Inside the definition, ``find`` must occur exactly once: as written, or, when
it is not there as written, with any run of whitespace matching any run of
whitespace (a re-indented or re-wrapped snippet); then the replacement is
re-indented by the same amount, so a Python mutant stays valid code.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

MODULE = "<module>"
PY_SUFFIXES = (".py",)
CPP_SUFFIXES = (".cpp", ".cc", ".cu", ".h", ".hpp", ".cuh")
# The product files a definition is looked for in when its file does not hold it.
SEARCHED = ("setup.py", "torch_kvswap", "csrc", "scripts", "tests/fake_*")
NOT_SEARCHED = ("scripts/mutants",)


@dataclass(frozen=True)
class Definition:
    name: str  # qualified: "Class.method" (Python), "ns::Class::method" (C++)
    file: str
    start: int  # offsets into the file's text: the definition's whole text
    end: int
    line: int
    method: bool = False  # a member of a class: named with it ("Class.method")

    def named(self, where: str) -> bool:
        sep = "::" if "::" in self.name or "::" in where else "."
        parts, wanted = self.name.split(sep), where.split(sep)
        return parts[-len(wanted) :] == wanted


@dataclass(frozen=True)
class Anchor:
    """A resolved mutant: the file to write, the span its snippet matched, the mutated text."""

    file: str
    start: int
    end: int
    line: int
    mutated: str
    definition: str | None  # None: the whole file

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (f" in {self.definition}" if self.definition else "")


def family(path: str) -> tuple[str, ...] | None:
    for suffixes in (PY_SUFFIXES, CPP_SUFFIXES):
        if path.endswith(suffixes):
            return suffixes
    return None


class Tree:
    """A source tree's texts and definitions, each read once."""

    def __init__(self, root: Path):
        self.root = root
        self._texts: dict[str, str | None] = {}
        self._defs: dict[str, list[Definition]] = {}
        self._family: dict[tuple[str, ...], list[str]] = {}

    def text(self, rel: str) -> str | None:
        if rel not in self._texts:
            path = self.root / rel
            self._texts[rel] = path.read_text() if path.is_file() else None
        return self._texts[rel]

    def definitions(self, rel: str) -> list[Definition]:
        if rel not in self._defs:
            text = self.text(rel)
            if text is None:
                self._defs[rel] = []
            elif rel.endswith(PY_SUFFIXES):
                self._defs[rel] = python_definitions(rel, text)
            else:
                self._defs[rel] = cpp_definitions(rel, text)
        return self._defs[rel]

    def files(self, suffixes: tuple[str, ...]) -> list[str]:
        if suffixes not in self._family:
            found = set()
            for pattern in SEARCHED:
                for top in self.root.glob(pattern):
                    paths = [top] if top.is_file() else top.rglob("*")
                    for p in paths:
                        rel = p.relative_to(self.root).as_posix()
                        if p.is_file() and rel.endswith(suffixes) and not rel.startswith(NOT_SEARCHED):
                            found.add(rel)
            self._family[suffixes] = sorted(found)
        return self._family[suffixes]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# --- Python ------------------------------------------------------------------


def python_definitions(rel: str, text: str) -> list[Definition]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out: list[Definition] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out.append(
                    Definition(
                        name,
                        rel,
                        starts[first - 1],
                        starts[child.end_lineno],
                        child.lineno,
                        isinstance(node, ast.ClassDef),
                    )
                )
                visit(child, name + ".")
            elif not isinstance(child, ast.expr):
                visit(child, prefix)

    visit(tree, "")
    return out


# --- C++ ---------------------------------------------------------------------

_NOT_A_NAME = {
    "if",
    "for",
    "while",
    "switch",
    "catch",
    "return",
    "sizeof",
    "alignof",
    "alignas",
    "decltype",
    "noexcept",
    "throw",
    "static_assert",
    "__attribute__",
    "__declspec",
    "requires",
    "void",
    "int",
    "char",
    "bool",
    "auto",
    "__launch_bounds__",
}


_RAW = re.compile(r'"([^()\\\s]{0,16})\(')  # a raw string's opening: R"delim(


def mask_cpp(text: str) -> str:
    """The text with comments, literals' contents and preprocessor lines blanked
    (newlines kept, offsets unchanged), so that braces can be counted."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    line_start = True
    while i < n:
        c = text[i]
        if c == "\n":
            line_start, i = True, i + 1
            continue
        if c in " \t":
            i += 1
            continue
        if line_start and c == "#":
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
            blank(i, j)
            i = j
            continue
        line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c == '"' and i > 0 and text[i - 1] == "R" and _RAW.match(text, i):
            m = _RAW.match(text, i)
            close = text.find(")" + m.group(1) + '"', m.end())
            j = n if close < 0 else close + len(m.group(1)) + 2
            blank(i + 1, j - 1)
            i = j
        elif c in "\"'":
            word = re.compile(r"[\w.]*$").search(text, 0, i).group(0)
            if c == "'" and word[:1].isdigit():  # a digit separator: 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _matching(masked: str, i: int, opening: str, closing: str) -> int:
    """The offset just after the bracket that closes the one at i."""
    depth = 0
    for j in range(i, len(masked)):
        if masked[j] == opening:
            depth += 1
        elif masked[j] == closing:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(masked)


def _function_name(head: str) -> tuple[str, bool] | None:
    """(qualified name, has a constructor's initializer list) of a function
    head such as ``static void kvswap::f(int a) const``; None if it is not one."""
    depth = angle = 0
    for m in re.finditer(r"[()<>]", head):
        c = m.group(0)
        if c in "<>" and depth == 0:
            if not head[: m.start()].rstrip().rstrip("<>=").endswith("operator"):
                angle += 1 if c == "<" else -1
            continue
        if c == ")":
            depth -= 1
            continue
        if c != "(" or depth or angle > 0:
            depth += c == "("
            continue
        name = re.search(
            r"(~?[A-Za-z_]\w*(?:\s*::\s*~?[A-Za-z_]\w*)*|operator\s*\S+?)\s*$", head[: m.start()]
        )
        depth += 1
        if not name or name.group(1).split("::")[-1].strip() in _NOT_A_NAME:
            continue
        rest = head[_matching(head, m.start(), "(", ")") :]
        return re.sub(r"\s+", "", name.group(1)), bool(re.search(r"(?<!:):(?!:)", rest))
    return None


def _classify(head: str) -> tuple[str, str, bool]:
    """(kind, name, initializer list) of the text before a brace at namespace or class level."""
    h = " ".join(head.split())
    m = re.match(r"(?:inline )?namespace\b\s*([\w:]*)", h)
    if m:
        return "namespace", m.group(1), False
    if re.fullmatch(r'extern ?" *"', h):
        return "namespace", "", False
    body = re.sub(r"^template ?<.*?> ?", "", h)
    m = re.match(r"(?:class|struct|union)\b(.*)", body)
    if m and "=" not in body and "(" not in re.sub(r"alignas ?\(.*?\)", "", body):
        names = re.findall(r"[A-Za-z_]\w*", re.split(r"(?<!:):(?!:)", m.group(1))[0])
        names = [x for x in names if x != "final"]
        return "class", names[-1] if names else "", False
    if h.startswith("enum") or ("=" in body.split("(")[0] and "operator" not in h):
        return "other", "", False
    found = _function_name(h)
    if found:
        return "function", found[0], found[1]
    return "other", "", False


def cpp_definitions(rel: str, text: str) -> list[Definition]:
    """Functions (and macro blocks such as ``TORCH_LIBRARY_IMPL(...) {``) and classes
    defined at namespace or class level, with their heads (template lines
    included), and macros (``#define``)."""
    masked = mask_cpp(text)
    out: list[Definition] = []

    def scope(i: int, end: int, prefix: str, in_class: bool) -> None:
        head = i
        while i < end:
            c = masked[i]
            if c in ";}":
                head, i = i + 1, i + 1
            elif c == "(":
                i = _matching(masked, i, "(", ")")
            elif c == "{":
                kind, name, init_list = _classify(masked[head:i])
                if kind == "function" and init_list and re.search(r"[\w>]\s*$", masked[head:i]):
                    i = _matching(masked, i, "{", "}")  # a member's brace initializer
                    continue
                close = _matching(masked, i, "{", "}")
                start = head + len(masked[head:i]) - len(masked[head:i].lstrip())
                qualified = prefix + name if name else prefix.rstrip(":") if prefix else ""
                if kind in ("function", "class") and name:
                    out.append(
                        Definition(
                            qualified, rel, start, close, _line_of(text, start), in_class or "::" in name
                        )
                    )
                if kind in ("namespace", "class"):
                    scope(i + 1, close - 1, (qualified + "::") if qualified else "", kind == "class")
                head = i = close
            else:
                i += 1

    scope(0, len(masked), "", False)
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?:.*\\\n)*.*$", text, re.MULTILINE):
        out.append(Definition(m.group(1), rel, m.start(), m.end(), _line_of(text, m.start())))
    return out


# --- matching a snippet ----------------------------------------------------------


def _loose(find: str) -> re.Pattern:
    return re.compile(r"\s+".join(re.escape(word) for word in find.split()))


def matches(
    text: str, start: int, end: int, find: str, python: bool = False
) -> tuple[list[tuple[int, int]], bool]:
    """The spans of `find` in text[start:end]: as written if it is there, else
    whitespace-insensitive (its leading and trailing whitespace left out).
    In Python, a `find` that starts with indentation matches only at a line's
    indentation, so that a deeper-indented line is re-indented, not cut."""

    def kept(i: int, exact: bool) -> bool:
        if not (python and find[:1].isspace()):
            return True
        if exact and find[:1] in " \t":
            return i == 0 or text[i - 1] == "\n"
        return not text[text.rfind("\n", 0, i) + 1 : i].strip()

    exact, i = [], text.find(find, start, end)
    while i >= 0 and find:
        if kept(i, True):
            exact.append((i, i + len(find)))
        i = text.find(find, i + 1, end)
    if exact or not find.strip():
        return exact, True
    loose = _loose(find).finditer(text, start, end)
    return [(m.start(), m.end()) for m in loose if kept(m.start(), False)], False


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def loose_replacement(text: str, span: tuple[int, int], find: str, replace: str, python: bool) -> str:
    """`replace` for a whitespace-insensitive match: the whitespace around `find`
    dropped from it, and for Python re-indented like the matched text."""
    lead, trail = find[: len(find) - len(find.lstrip())], find[len(find.rstrip()) :]
    core = replace[len(lead) :] if replace.startswith(lead) else replace.lstrip()
    core = core[: len(core) - len(trail)] if trail and core.endswith(trail) else core.rstrip()
    if not python:
        return core
    found, written = text[span[0] : span[1]].split("\n"), find.strip().split("\n")
    if len(found) > 1 and len(written) > 1:
        shift = _indent(found[1]) - _indent(written[1])
    else:
        line_start = text.rfind("\n", 0, span[0]) + 1
        shift = span[0] - line_start - _indent(lead.split("\n")[-1]) if lead else 0
    lines = core.split("\n")
    for k in range(1, len(lines)):
        if lines[k].strip():
            lines[k] = " " * shift + lines[k] if shift >= 0 else lines[k][min(-shift, _indent(lines[k])) :]
    return "\n".join(lines)


def _apply(
    tree: Tree, rel: str, span: tuple[int, int], exact: bool, find: str, replace: str, definition: str | None
) -> Anchor:
    text = tree.text(rel)
    new = replace if exact else loose_replacement(text, span, find, replace, rel.endswith(PY_SUFFIXES))
    return Anchor(
        rel, span[0], span[1], _line_of(text, span[0]), text[: span[0]] + new + text[span[1] :], definition
    )


def resolve(
    tree: Tree, file: str, where: str | None, find: str, replace: str, search_only: bool = False
) -> Anchor | str:
    """Where the mutant applies, or why it cannot (a sentence naming the problem).
    With search_only, `file` is not looked at first (as if it had been renamed)."""
    if not where or where == MODULE:
        text = tree.text(file)
        if text is None:
            return f"{file} does not exist"
        spans, exact = matches(text, 0, len(text), find, file.endswith(PY_SUFFIXES))
        if len(spans) != 1:
            return (
                f"its find snippet occurs {len(spans)} times in {file} (must be exactly once); "
                "update the mutant"
            )
        return _apply(tree, file, spans[0], exact, find, replace, None)
    suffixes = family(file)
    if suffixes is None:
        return f"where= is for Python and C++ files, not {file}"
    candidates = [] if search_only else [d for d in tree.definitions(file) if d.named(where)]
    if not candidates:
        candidates = [d for f in tree.files(suffixes) for d in tree.definitions(f) if d.named(where)]
    if not candidates:
        gone = " (which does not exist)" if tree.text(file) is None else ""
        return (
            f"where={where!r}: no such definition in {file}{gone}, nor in any other "
            f"{'/'.join(suffixes)} file of the tree; update the mutant"
        )
    places = ", ".join(f"{d.name} at {d.file}:{d.line}" for d in candidates)
    for exact_only in (True, False):
        found = {}
        for d in candidates:
            spans, exact = matches(tree.text(d.file), d.start, d.end, find, d.file.endswith(PY_SUFFIXES))
            if exact == exact_only:
                for span in spans:
                    found.setdefault((d.file, span), (d, exact))
        if found:
            break
    if len(found) != 1:
        return (
            f"where={where!r}: its find snippet occurs {len(found)} times in {places} "
            "(must be exactly once); update the mutant"
        )
    (rel, span), (d, exact) = next(iter(found.items()))
    return _apply(tree, rel, span, exact, find, replace, d.name)


def enclosing(tree: Tree, anchor: Anchor) -> Definition | None:
    """The innermost definition that holds the anchor's whole span."""
    holding = [d for d in tree.definitions(anchor.file) if d.start <= anchor.start and anchor.end <= d.end]
    return min(holding, key=lambda d: d.end - d.start, default=None)


def anchor_name(tree: Tree, file: str, find: str, replace: str, anchor: Anchor) -> str | None:
    """The shortest name of the anchor's enclosing definition that resolves to the
    same place, by a search of the tree if possible (so a rename keeps it), else
    within its file; None at module level or when no name is unambiguous."""
    d = enclosing(tree, anchor)
    if d is None:
        return None
    sep = "::" if file.endswith(CPP_SUFFIXES) else "."
    parts = d.name.split(sep)
    shortest = min(2 if d.method else 1, len(parts))
    names = [sep.join(parts[-k:]) for k in range(shortest, len(parts) + 1)]
    for search_only in (True, False):
        for name in names:
            got = resolve(tree, file, name, find, replace, search_only)
            if isinstance(got, Anchor) and (got.file, got.start) == (anchor.file, anchor.start):
                return name
    return None


def insert_where(source: str, names: dict[str, str]) -> tuple[str, list[str]]:
    """The text of a mutant file with ``where="..."`` written into the
    ``dict(...)`` of each mutant named in `names` that has no ``where`` yet:
    as its own line after the ``file=`` line, indented like the keyword that
    follows, or inline before that keyword when it shares the line. Returns
    the text and the names whose dict was not found."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (line index, column, text)
    done = set()
    for call in ast.walk(ast.parse(source)):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "dict"):
            continue
        kw = {k.arg: k for k in call.keywords if k.arg}
        name = kw.get("name")
        name = name.value.value if name and isinstance(name.value, ast.Constant) else None
        if name not in names or "where" in kw or "file" not in kw:
            continue
        following = [
            k for k in call.keywords if (k.lineno, k.col_offset) > (kw["file"].lineno, kw["file"].col_offset)
        ]
        if not following:
            continue
        nxt = following[0]
        row = nxt.lineno - 1
        prefix = lines[row].encode()[: nxt.col_offset].decode()  # col_offset counts UTF-8 bytes
        if nxt.lineno > kw["file"].end_lineno and not prefix.strip():
            edits.append((row, 0, f'{prefix}where="{names[name]}",\n'))
        else:
            edits.append((row, len(prefix), f'where="{names[name]}", '))
        done.add(name)
    for row, col, text in sorted(edits, reverse=True):
        lines[row] = lines[row][:col] + text + lines[row][col:]
    return "".join(lines), sorted(set(names) - done)
