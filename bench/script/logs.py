"""What ``bench script`` reads from rank 0's log: each step's wall time and CPU, the first
step's loss and the global batch a run trained with."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bench.script.variants import WORLD

@dataclass(frozen=True)
class Stamp:
    """Rank 0 at the end of one step: wall time (epoch seconds) and process CPU seconds."""

    step: int
    t: float
    cpu_s: float


def _json_lines(text: str) -> Iterable[dict[str, Any]]:
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(value, dict):
            yield value


def anchor_stamps(text: str) -> list[Stamp]:
    """The anchor's rank-0 lines ``{"step", "t", "cpu_s", ...}``, in step order."""
    found = {
        v["step"]: Stamp(int(v["step"]), float(v["t"]), float(v["cpu_s"]))
        for v in _json_lines(text)
        if {"step", "t", "cpu_s"} <= v.keys()
    }
    return [found[k] for k in sorted(found)]


def first_loss(text: str, world: int = WORLD) -> float | None:
    """The first step's loss, the mean over ranks: from the anchor's ``{"rank", "first_loss"}``
    lines (one per rank; None unless all ``world`` are readable: the ranks share one log, and
    lines written at once can mix), or from the API's first ``step`` event (the boundary's mean)."""
    ranks = {int(v["rank"]): float(v["first_loss"]) for v in _json_lines(text) if "first_loss" in v and "rank" in v}
    if ranks:
        return sum(ranks.values()) / len(ranks) if len(ranks) == world else None
    steps = [v for v in _json_lines(text) if v.get("event") == "step" and v.get("step") == 1 and "loss" in v]
    return float(steps[0]["loss"]) if steps else None


def same_training(without: float | None, with_: float | None, rel: float = 1e-4) -> bool:
    """Whether two runs' first-step losses agree: the same model, data and loss."""
    if without is None or with_ is None:
        return False
    return abs(without - with_) <= rel * max(abs(without), abs(with_), 1e-12)


def api_stamps(text: str) -> list[Stamp]:
    """Rank 0's ``{"event": "step", "step", "timestamp" (ISO), "cpu_s", ...}`` log events, in
    step order (a repeated step, as after a re-form, keeps its last record)."""
    found: dict[int, Stamp] = {}
    for v in _json_lines(text):
        if v.get("event") != "step" or "cpu_s" not in v or v.get("rank", 0) != 0:
            continue
        t = datetime.fromisoformat(str(v["timestamp"]).replace("Z", "+00:00")).timestamp()
        found[int(v["step"])] = Stamp(int(v["step"]), t, float(v["cpu_s"]))
    return [found[k] for k in sorted(found)]


def global_batch_of(text: str) -> int | None:
    """The global batch a run trained with, from rank 0's ``training`` event (world size x
    micro-batch x accumulation)."""
    for v in _json_lines(text):
        if v.get("event") == "training" and {"world_size", "micro_batch", "accumulation"} <= v.keys():
            return int(v["world_size"]) * int(v["micro_batch"]) * int(v["accumulation"])
    return None
