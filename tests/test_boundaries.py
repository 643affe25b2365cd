"""The architecture's import boundaries hold (STYLE: boundaries are checked by a tool)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    config = REPO / ".importlinter"
    result = subprocess.run([str(lint), str(config)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = config.read_text().count("[importlinter:contract:")
    assert contracts >= 6 and f"Contracts: {contracts} kept, 0 broken" in result.stdout, result.stdout


def _project_sources() -> list[Path]:
    """Every Python file of the project's packages (the top-level folders with an
    ``__init__.py``), tests excepted."""
    packages = [p for p in sorted(REPO.iterdir()) if (p / "__init__.py").is_file() and p.name != "tests"]
    return [path for package in packages for path in sorted(package.rglob("*.py"))]


def _lines_calling(calls: tuple[str, ...], allowed: set[Path]) -> list[str]:
    found = []
    for path in _project_sources():
        if path in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(call in line for call in calls):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    return found


ETCD_LAYER = REPO / "regroup" / "etcd"


def test_every_etcd_watch_is_opened_through_the_etcd_layer() -> None:
    """``regroup.etcd.open_watch`` honours a cancellation aetcd's watch creation can drop on
    Python 3.11; a watch opened any other way could hang whoever cancels its task."""
    offenders = _lines_calling((".watch_prefix(", "client.watch("), {ETCD_LAYER / "watch.py"})
    assert not offenders, "\n".join(offenders)


def test_only_the_reflector_opens_watches() -> None:
    """One list-and-watch loop (``regroup.etcd.Reflector``) handles relists, back-off and
    cancellation for everyone: no module keeps a watch loop of its own."""
    offenders = _lines_calling(("open_watch(",), {ETCD_LAYER / "watch.py", ETCD_LAYER / "reflector.py"})
    assert not offenders, "\n".join(offenders)
