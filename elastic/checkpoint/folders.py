"""Checkpoint folders on disk: ``<dir>/step-N/``, valid only with their commit marker.

A ``step-N`` folder holds DCP's shard files and ``.metadata``; ``COMMITTED`` is written
into it last, atomically, once every rank's shard is on disk. A folder without the marker
is never loaded: it is removed at the next start, or once a newer checkpoint commits.
Retention keeps the newest ``keep_last`` committed folders.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

COMMIT_MARKER = "COMMITTED"
_PREFIX = "step-"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step}"


def checkpoint_id(step: int) -> str:
    """The id acks and logs use for a checkpoint: its folder name."""
    return f"{_PREFIX}{step}"


def _parse_step(name: str) -> int | None:
    if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
        return int(name[len(_PREFIX) :])
    return None


def is_committed(path: Path) -> bool:
    return (path / COMMIT_MARKER).is_file()


def list_steps(root: Path) -> list[tuple[int, bool]]:
    """(step, committed) of every ``step-N`` folder, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _parse_step(child.name)
        if step is not None and child.is_dir():
            found.append((step, is_committed(child)))
    return sorted(found)


def latest_committed(root: Path) -> int | None:
    committed = [step for step, ok in list_steps(root) if ok]
    return committed[-1] if committed else None


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_commit_marker(path: Path, step: int, world_size: int) -> None:
    """Write the marker atomically (temp file, fsync, rename, fsync the folder)."""
    body = json.dumps({"step": step, "world_size": world_size, "committed_at": time.time()}).encode()
    tmp = path / f".{COMMIT_MARKER}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path / COMMIT_MARKER)
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_uncommitted(root: Path) -> list[int]:
    """Delete every folder without a commit marker (torn saves of earlier runs)."""
    removed = []
    for step, committed in list_steps(root):
        if not committed:
            shutil.rmtree(step_dir(root, step), ignore_errors=True)
            removed.append(step)
    return removed


def prune(root: Path, keep_last: int) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep_last``, and uncommitted
    folders older than the newest committed one (failed saves)."""
    steps = list_steps(root)
    committed = [s for s, ok in steps if ok]
    newest = committed[-1] if committed else None
    doomed = committed[:-keep_last] if len(committed) > keep_last else []
    doomed += [s for s, ok in steps if not ok and newest is not None and s < newest]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return sorted(doomed)
