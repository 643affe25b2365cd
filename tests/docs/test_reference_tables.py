"""The docs' reference tables list exactly what the code accepts: a key renamed, added or
dropped in the code fails here, naming the table, rather than leaving a reader with a key
that is refused at start.

- docs/rendezvous.md, "`--rdzv-conf` options": one row per key of the etcd-v3 backend's own
  (``CONF_KEYS``), each other backend's name for it in parentheses (``ALIASES``); the prose
  under the table names the keys accepted for torch's sake (``KEEP_ALIVE_KEYS``,
  ``NO_EFFECT``).
"""

from __future__ import annotations

import re

from tests.docs.markdown import REPO, prose_lines

RENDEZVOUS = REPO / "docs" / "rendezvous.md"
RDZV_CONF_HEADING = "## `--rdzv-conf` options"


def _section(path_text: str, heading: str) -> list[tuple[int, str]]:
    """(line, text) of the prose lines under heading, up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = prose_lines(path_text)
    start = next((i for i, (_, line) in enumerate(lines) if line.strip() == heading), None)
    assert start is not None, f"no heading {heading!r}"
    section = []
    for number, line in lines[start + 1 :]:
        match = re.match(r"^(#{1,6})\s", line)
        if match and len(match.group(1)) <= level:
            break
        section.append((number, line))
    return section


def _table_rows(section: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """(line, cells) of the first table's body rows."""
    rows: list[tuple[int, list[str]]] = []
    for number, line in section:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append((number, [cell.strip() for cell in line.strip().strip("|").split("|")]))
    assert len(rows) > 2, "no table"
    return [row for row in rows[1:] if not re.fullmatch(r":?-+:?", row[1][0])]


def _keys_of(cell: str) -> tuple[list[str], list[str]]:
    """A key cell's own keys, and the other names given in parentheses:
    "`cert`, `key` (`ssl_cert`, `ssl_cert_key`)" -> (["cert", "key"], ["ssl_cert", "ssl_cert_key"])."""
    inside = " ".join(re.findall(r"\(([^)]*)\)", cell))
    outside = re.sub(r"\([^)]*\)", " ", cell)
    return re.findall(r"`([^`]+)`", outside), re.findall(r"`([^`]+)`", inside)


def test_the_rdzv_conf_table_lists_exactly_the_keys_the_backend_takes() -> None:
    from regroup.rendezvous import settings

    section = _section(RENDEZVOUS.read_text(), RDZV_CONF_HEADING)
    listed: dict[str, int] = {}
    problems = []
    for number, cells in _table_rows(section):
        own, others = _keys_of(cells[0])
        assert own, f"docs/rendezvous.md:{number}: a row without a key in its first cell"
        for key in own:
            if key in listed:
                problems.append(f"docs/rendezvous.md:{number}: {key} is listed twice")
            listed[key] = number
        for name in others:
            target = settings.ALIASES.get(name)
            if target is None:
                problems.append(f"docs/rendezvous.md:{number}: ({name}) is not another name for a key (ALIASES)")
            elif target not in own:
                problems.append(f"docs/rendezvous.md:{number}: ({name}) stands for {target}, not for {', '.join(own)}")
        for alias, target in settings.ALIASES.items():
            if target in own and alias not in others:
                problems.append(f"docs/rendezvous.md:{number}: {target}'s other name {alias} is missing from its parentheses")
    for key in sorted(set(listed) - set(settings.CONF_KEYS)):
        problems.append(f"docs/rendezvous.md:{listed[key]}: the backend takes no key {key!r} (CONF_KEYS: {', '.join(settings.CONF_KEYS)})")
    for key in settings.CONF_KEYS:
        if key not in listed:
            problems.append(f"docs/rendezvous.md: the table of {RDZV_CONF_HEADING!r} lacks the key {key!r} (CONF_KEYS)")
    assert not problems, "\n".join(problems)


def test_the_rdzv_conf_section_names_the_keys_kept_for_torch() -> None:
    from regroup.rendezvous import settings

    section = _section(RENDEZVOUS.read_text(), RDZV_CONF_HEADING)
    named = {span for _, line in section for span in re.findall(r"`([^`]+)`", line)}
    names = [*settings.KEEP_ALIVE_KEYS, *settings.NO_EFFECT]
    missing = [name for name in names if name not in named and not any(name in span.split("/") for span in named)]
    assert not missing, f"docs/rendezvous.md, {RDZV_CONF_HEADING!r}: keys accepted for torch's sake but not named: {missing}"
