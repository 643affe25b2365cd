"""Markdown as the doc checks see it: fenced code blocks, inline code spans, links and heading anchors.

Nothing here knows today's docs: the blocks, links and headings are found at test time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def doc_files(repo: Path = REPO) -> list[Path]:
    """The user-facing docs: README.md, docs/**/*.md and examples/README.md."""
    files = [repo / "README.md", *sorted((repo / "docs").glob("**/*.md")), repo / "examples" / "README.md"]
    return [f for f in files if f.is_file()]


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a doc, at a line of it."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_OPT_OUT = re.compile(r"^\s*(?:#|//|<!--)\s*not-tested\s*:?(?P<reason>.*?)(?:-->)?\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: ``line`` is the line of its opening fence (1-based)."""

    path: str
    line: int
    lang: str
    body: tuple[str, ...]

    @property
    def first_line(self) -> int:
        """The file's line number of ``body[0]``."""
        return self.line + 1

    @property
    def opt_out(self) -> str | None:
        """The reason given by a ``# not-tested: <reason>`` first line ("" if none given); None if not opted out."""
        if not self.body:
            return None
        match = _OPT_OUT.match(self.body[0])
        return match.group("reason").strip() if match else None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.lang or 'plain'}"


def fenced_blocks(text: str, path: str) -> list[Block]:
    """Every fenced code block of a markdown text (a fence left open runs to the end)."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match or (match.group("fence")[0] == "`" and "`" in match.group("info")):
            i += 1
            continue
        indent, fence = len(match.group("indent")), match.group("fence")
        lang = (match.group("info").strip().split() or [""])[0].lower().strip("{}.")
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            line = lines[j]
            cut = len(line) - len(line.lstrip(" "))
            body.append(line[min(cut, indent):])
            j += 1
        blocks.append(Block(path, i + 1, lang, tuple(body)))
        i = j + 1
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines = text.split("\n")
    inside = {n for b in fenced_blocks(text, "") for n in range(b.line, b.line + len(b.body) + 2)}
    return [(n, line) for n, line in enumerate(lines, 1) if n not in inside]


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _without_code_spans(line: str) -> str:
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


# A run of backticks opens a span that the next run of the same length closes; the span may
# run on over line breaks within its paragraph, but not over a blank line.
_MULTILINE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)


@dataclass(frozen=True)
class Span:
    """An inline code span: ``line`` is the line it opens on (1-based); ``text`` as CommonMark
    reads it (line breaks as spaces, one leading and trailing space stripped)."""

    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:`{self.text}`"


def code_spans(text: str, path: str) -> list[Span]:
    """Every inline code span outside fenced code blocks."""
    lines = text.split("\n")
    inside = {n for b in fenced_blocks(text, "") for n in range(b.line, b.line + len(b.body) + 2)}
    prose = "\n".join("" if n in inside else line for n, line in enumerate(lines, 1))
    spans: list[Span] = []
    for match in _MULTILINE_SPAN.finditer(prose):
        body = re.sub(r"[ \t]*\n[ \t]*", " ", match.group(2))
        if body.startswith(" ") and body.endswith(" ") and body.strip():
            body = body[1:-1]
        spans.append(Span(path, prose.count("\n", 0, match.start()) + 1, body))
    return spans


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text, lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    parts = re.split(r"(`+[^`]*`+)", text)
    out = []
    for part in parts:
        if part.startswith("`"):
            out.append(part.strip("`"))
        else:
            part = part.replace("*", "")
            part = re.sub(r"(?<!\w)_+|_+(?!\w)", "", part)  # _emphasis_, not snake_case
            out.append(part)
    text = "".join(out).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


_ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_HTML_ID = re.compile(r"""<a\s[^>]*?(?:name|id)\s*=\s*["']([^"']+)["']|\sid\s*=\s*["']([^"']+)["']""")


def anchors(text: str) -> set[str]:
    """The anchors a markdown file offers: its headings' slugs (duplicates numbered) and HTML ids."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    prose = prose_lines(text)
    for index, (_, line) in enumerate(prose):
        heading = None
        match = _ATX.match(line)
        if match:
            heading = match.group(2)
        elif (
            index + 1 < len(prose)
            and line.strip()
            and not line.lstrip().startswith(("-", "|", ">", "*"))
            and re.fullmatch(r"\s{0,3}(=+|-+)\s*", prose[index + 1][1])
            and prose[index + 1][0] == prose[index][0] + 1
        ):
            heading = line.strip()
        if heading is not None:
            slug = github_slug(heading)
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
        for html in _HTML_ID.finditer(line):
            found.add(html.group(1) or html.group(2))
    return found


_INLINE_LINK = re.compile(r"\]\(\s*<?([^()\s<>]+(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\s(?:href|src)\s*=\s*["']([^"']+)["']""")


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link, image and reference definition outside code."""
    found: list[tuple[int, str]] = []
    for number, line in prose_lines(text):
        line = _without_code_spans(line)
        for pattern in (_INLINE_LINK, _HTML_LINK):
            found.extend((number, m.group(1)) for m in pattern.finditer(line))
        ref = _REF_DEF.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return found
