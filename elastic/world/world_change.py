"""How the trainer's current world came to be, and what resuming in it cost.

Rank 0 publishes it in ``progress`` (``reform_mode``, ``resume_phases``) once the first
step in the new world is done; the controller copies it into the re-form's trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WorldChange:
    """The latest change of world of this process."""

    mode: str = ""
    """``in-place`` (this process survived it), ``restart`` (this process was started
    for it), or "" (the job's first start)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds: ``startup``, ``process_group``, ``reshard`` or ``load``, ``first_step``."""
    traceparent: str = ""
    """The re-form's trace, when a controller request caused it."""
    started_ns: int = field(default_factory=time.time_ns)
    """Unix time (ns) the resume began: the trainer's resume span starts here."""
    first_step_done: bool = False

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = round(self.phases.get(phase, 0.0) + seconds, 6)
