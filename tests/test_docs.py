"""The README and docs/ at the sizes a reader finishes: the README's first
screen gives the two commands and an example that runs on a CPU as written,
at most 1,000 words in all; no page of docs/ is over 2,500 words; every
relative link leads to a file and every ``#anchor`` to a heading of it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
FIRST_SCREEN = 60


def words(path: Path) -> int:
    return len(path.read_text().split())


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def test_the_readme_is_at_most_1000_words():
    assert words(README) <= 1000


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_of_the_docs_is_over_2500_words(page):
    assert words(page) <= 2500


def test_the_first_screen_gives_the_two_commands_and_a_python_example():
    screen = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    commands = [ln.split("#")[0].strip() for block in fenced(screen, "bash") for ln in block.splitlines()]
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert len(fenced(screen, "python")) == 1


def test_the_readmes_example_runs_on_a_cpu_as_written_and_prints_what_the_readme_shows():
    (example,) = fenced("\n".join(README.read_text().splitlines()[:FIRST_SCREEN]), "python")
    shown = fenced(README.read_text(), "text")[0]  # the block right after the example
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {"__name__": "readme_example"})
    moved = 4 * 2 * 4 * (16 * 8 * 64 * 4)  # layers, K/V, device blocks, bytes per block
    assert out.getvalue().splitlines() == [f"1 True {moved}", f"2 True {moved}", "round trip exact: True"]
    assert out.getvalue() == shown


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {anchor(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", [README, ROOT / "CHANGELOG.md", *PAGES], ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, fragment = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists() or (fragment and path.suffix == ".md" and fragment not in anchors(path)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"
