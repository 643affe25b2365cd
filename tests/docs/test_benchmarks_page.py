"""docs/benchmarks.md holds the current result of every benchmark, one ``##`` section each,
in one shape: what it runs, the command, the machine, the table, how to read it.

- The index at the top names each benchmark of ``bench/`` once (``- [title](#anchor)
  (`name`)``), and each entry leads to a ``##`` section of the page.
- Each section (its ``###`` parts included) holds a command block that starts its
  benchmark (``python -m bench NAME`` or ``make bench ARGS="NAME ..."``), a paragraph that
  opens with **Machine**, a table (or, in its Machine paragraph, a link to the section of
  this page whose table stands for it) and a paragraph that opens with **How to read it.**
- Earlier results leave the page (git has them): no result is set against an earlier one.
"""

from __future__ import annotations

import pkgutil
import re

import pytest

from tests.docs.markdown import REPO, fenced_blocks, github_slug, prose_lines

PAGE = REPO / "docs" / "benchmarks.md"
TEXT = PAGE.read_text()
NOT_A_BENCHMARK = {"Headline numbers"}
HISTORY = re.compile(
    r"\b(earlier (run|result|tree|try|version)s?|previous (tree|run|result|version)s?|older (reshard|tree|run|code)"
    r"|this tree|re-run|superseded|until this|was dropped|used to|no longer)\b",
    re.I,
)


def _benchmarks() -> list[str]:
    import bench

    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def _index() -> list[tuple[str, str]]:
    """(anchor, benchmark name) of each entry of the index."""
    return re.findall(r"^- \[[^\]]+\]\(#([^)]+)\) \(`([\w-]+)`\)\s*$", TEXT, flags=re.M)


def _sections() -> dict[str, tuple[str, list[tuple[int, str]]]]:
    """Each ``##`` section by its anchor: its heading, and its lines (fenced blocks included)."""
    sections: dict[str, tuple[str, list[tuple[int, str]]]] = {}
    current: list[tuple[int, str]] | None = None
    for number, line in enumerate(TEXT.split("\n"), 1):
        heading = re.match(r"^## (.+?)\s*$", line)
        if heading and number in {n for n, _ in prose_lines(TEXT)}:
            current = []
            sections[github_slug(heading.group(1))] = (heading.group(1), current)
        elif current is not None:
            current.append((number, line))
    return sections


def test_the_index_names_every_benchmark_once_and_leads_to_its_section() -> None:
    index = _index()
    names = [name for _, name in index]
    assert sorted(names) == _benchmarks(), (
        f"docs/benchmarks.md's index names {sorted(names)}; bench/ has {_benchmarks()}"
    )
    sections = _sections()
    missing = [anchor for anchor, _ in index if anchor not in sections]
    assert not missing, f"index entries without a ## section: {missing}"
    unlisted = [heading for anchor, (heading, _) in sections.items() if anchor not in dict(index) and heading not in NOT_A_BENCHMARK]
    assert not unlisted, f"## sections the index does not list: {unlisted}"


@pytest.mark.parametrize("anchor, name", _index(), ids=[name for _, name in _index()])
def test_each_section_has_what_it_runs_the_command_the_machine_the_table_and_how_to_read_it(anchor: str, name: str) -> None:
    heading, lines = _sections()[anchor]
    body = "\n".join(line for _, line in lines)
    blocks = fenced_blocks(body, "")
    command = re.compile(rf"(python3? -m bench {re.escape(name)}\b|make bench ARGS=\"{re.escape(name)}\b)")
    first = next((line for _, line in lines if line.strip()), "")
    machine = [p for p in re.split(r"\n\s*\n", body) if p.startswith("**Machine")]
    problems = []
    if not first or first.startswith(("```", "|", "**", "#")):
        problems.append("does not open with a paragraph saying what it runs")
    if not any(command.search(line) for block in blocks for line in block.body):
        problems.append(f"has no command block that starts it (python -m bench {name} or make bench ARGS=\"{name}\")")
    if not machine:
        problems.append("has no paragraph opening with **Machine")
    has_table = any(re.match(r"^\|.*\|\s*$", line) for _, line in lines)
    if not has_table and not any(re.search(r"\]\(#[^)]+\)", p) for p in machine):
        problems.append("has no table, nor a Machine paragraph linking to the section whose table stands for it")
    if not re.search(r"^\*\*How to read it\.\*\*", body, flags=re.M):
        problems.append("has no paragraph opening with **How to read it.**")
    assert not problems, f"docs/benchmarks.md, ## {heading}: " + "; ".join(problems)


def test_the_page_holds_current_results_only() -> None:
    found = [f"docs/benchmarks.md:{n}: {m.group(0)!r} in: {line.strip()}" for n, line in prose_lines(TEXT) for m in HISTORY.finditer(line)]
    assert not found, "results set against earlier ones (git has those):\n" + "\n".join(found)
