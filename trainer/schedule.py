"""The learning-rate schedule: a pure function of the step, so resuming needs only the step."""

from __future__ import annotations

import math

from regroup.trainer.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine
    decay to ``lr * min_lr_ratio`` over ``decay_steps`` (or the rest of ``max_steps``)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay = optim.decay_steps or max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay)
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
