"""Every module stays small enough to read whole: at most ``MAX_LINES`` lines.

The modules of the installed package (``regroup``, with the folders it links in:
controller/, demo/, elastic/, rendezvous/, trainer/) and of bench/ and kubeapi/; tests are
not counted. A module that outgrows the limit is split by what its parts are.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 500
ROOTS = ("regroup", "bench", "kubeapi")


def modules(roots: tuple[str, ...] = ROOTS) -> list[Path]:
    """Every ``.py`` file under ``roots`` (linked folders followed), each once, by its real path."""
    found: set[Path] = set()
    for root in roots:
        for folder, dirs, files in os.walk(REPO / root, followlinks=True):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found.update(Path(folder, name).resolve() for name in files if name.endswith(".py"))
    return sorted(found)


def oversized(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` for each of ``paths`` longer than ``limit`` lines."""
    sizes = {path: len(path.read_text().splitlines()) for path in paths}
    return [f"{path.relative_to(REPO)}: {n} lines" for path, n in sizes.items() if n > limit]


def test_the_walk_finds_the_linked_packages_and_counts_lines(tmp_path: Path) -> None:
    found = {path.relative_to(REPO).as_posix() for path in modules()}
    assert {"regroup/cli.py", "demo/report.py", "controller/main.py", "bench/__init__.py", "kubeapi/__init__.py"} <= found
    assert not any(path.startswith("tests/") for path in found)
    small, big = REPO / "regroup" / "__init__.py", REPO / "demo" / "report.py"
    assert oversized([small, big], limit=len(small.read_text().splitlines())) == [
        f"demo/report.py: {len(big.read_text().splitlines())} lines"
    ]


def test_no_module_is_longer_than_the_limit() -> None:
    over = oversized(modules())
    assert not over, f"modules over {MAX_LINES} lines (split each by what its parts are):\n" + "\n".join(over)
