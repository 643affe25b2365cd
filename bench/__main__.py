"""``python -m bench NAME [ARGS]``: run ``bench.NAME.main(ARGS)``, the one way to start a
benchmark (``make bench ARGS="NAME ..."`` runs this). ``python -m bench --help`` lists the
benchmarks, one line each, from their docstrings, read without importing them.

A benchmark is a module or package of ``bench`` not named ``_*``; the ``_*`` modules are
the scripts and helpers the benchmarks run.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent


def summary(doc: str) -> str:
    """A docstring's one-line summary: its first paragraph that is more than a usage line
    (``python -m bench NAME [FLAGS]``: is dropped), up to its first sentence's end."""
    for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        if text.startswith("``python -m bench"):
            text = text.partition("``: ")[2]
        elif text.startswith("python -m bench"):
            text = ""
        if text:
            text = re.split(r"(?<=[.?!])\s+(?=[A-Z])", text.replace("``", ""))[0]
            return text[0].upper() + text[1:] if re.match(r"[a-z]+(-[a-z]+)*(\s|$)", text) else text
    return ""


def benchmarks() -> dict[str, str]:
    """Every benchmark's name and summary, by name."""
    found = {}
    for module in sorted(pkgutil.iter_modules([str(HERE)]), key=lambda m: m.name):
        if module.name.startswith("_"):
            continue
        path = HERE / module.name / "__init__.py" if module.ispkg else HERE / f"{module.name}.py"
        found[module.name] = summary(ast.get_docstring(ast.parse(path.read_text())) or "")
    return found


def usage(found: dict[str, str]) -> str:
    width = max(map(len, found), default=0)
    lines = [
        f"usage: python -m bench {{{','.join(found)}}} [--quick] [ARGS]",
        "       python -m bench NAME --help: that benchmark's flags",
        "",
        "benchmarks:",
        *(f"  {name:<{width}}  {text}" for name, text in found.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    found = benchmarks()
    if argv and argv[0] in ("-h", "--help"):
        print(usage(found))
        return 0
    if not argv or argv[0] not in found:
        if argv:
            print(f"python -m bench: no benchmark named {argv[0]!r}", file=sys.stderr)
        print(usage(found), file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
