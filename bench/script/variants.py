"""The variants ``bench script`` alternates and what they run: the anchor, the converted
example (and its no-snapshot copy), the world they train in and the run's settings."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).parent.parent
REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "examples" / "fsdp2" / "train.py"
ANCHOR = BENCH / "_script_anchor.py"
PROFILED = BENCH / "_profiled.py"
WORLD = 4
NODES = [f"n{i}" for i in range(WORLD)]
VARIANTS = ("without", "with")
NO_SNAPSHOTS = "with_no_snapshots"
"""A diagnostic variant: the converted example with ``snapshot_every=0``."""
SYNCED = "without_synced"
"""A second anchor: the plain loop that also all-reduces its loss every step."""


@dataclass
class Settings:
    global_batch: int
    steps: int
    warmup: int
    script_args: list[str] = field(default_factory=list)
    """Extra arguments for examples/fsdp2/train.py."""


def without_snapshots(root: Path) -> Path:
    """A copy of the example whose ``Run`` takes no snapshots (``snapshot_every=0``)."""
    folder = root / "fsdp2-no-snapshots"
    shutil.copytree(SCRIPT.parent, folder, ignore=shutil.ignore_patterns("upstream", "__pycache__"))
    text = SCRIPT.read_text()
    if "snapshot_every=1" not in text:
        raise RuntimeError(f"{SCRIPT.name} no longer says snapshot_every=1: the no-snapshot variant cannot be made")
    (folder / SCRIPT.name).write_text(text.replace("snapshot_every=1", "snapshot_every=0"))
    return folder / SCRIPT.name
