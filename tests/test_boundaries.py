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


def test_every_etcd_watch_is_opened_through_the_etcd_layer() -> None:
    """``regroup.etcd.open_watch`` honours a cancellation aetcd's watch creation can drop on
    Python 3.11; a watch opened any other way could hang whoever cancels its task."""
    offenders = []
    for package in ("controller", "rendezvous", "trainer", "regroup", "demo", "kubeapi", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "regroup" / "etcd.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if ".watch_prefix(" in line or "client.watch(" in line:
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
