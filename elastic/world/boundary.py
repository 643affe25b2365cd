"""The step-boundary agreement: one tiny all-reduce per step.

Every rank contributes its stop flag, whether its agent announced an in-place re-form,
its local loss, whether its in-memory snapshot in flight is complete, what snapshots
cost it, and its step (with its square, so that ranks at different steps are detected: a
rank that skipped a boundary is an error, not a silent drift); rank 0 alone contributes the checkpoint-request generation it saw and whether a
timed save is due (its clock decides, so ranks never disagree). One SUM all-reduce of
nine float64 numbers gives every rank the same decision; with nothing pending nothing
else happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Boundary:
    """What all ranks agreed at one step boundary."""

    generation: int
    """Checkpoint request to honour now (0: none)."""
    stop: bool
    """Some rank was asked to stop: every rank stops here."""
    save_due: bool
    """The periodic time trigger fired on rank 0."""
    loss: float
    """Mean of the ranks' losses (equal shares of the global batch: the global mean)."""
    reform: bool = False
    """Some rank's agent announced an in-place re-form: every rank leaves the world here."""
    snapshot_done: bool = True
    """Every rank completed its in-flight in-memory snapshot (copied, sent and received)."""
    snapshot_cost: float = 0.0
    """Mean over ranks of what a snapshot costs, as a share of a step without one."""
    same_step: bool = True
    """Every rank reached this boundary at the same step (a rank that skipped or added a
    step makes its peers agree with the wrong boundary: an error, not a silent drift)."""


def agree(
    group: dist.ProcessGroup,
    world_size: int,
    *,
    generation: int,
    stop: bool,
    save_due: bool,
    loss: float,
    reform: bool = False,
    snapshot_done: bool = True,
    snapshot_cost: float = 0.0,
    step: int = 0,
) -> Boundary:
    values = torch.tensor(
        [
            float(generation), float(stop), float(save_due), loss, float(reform), float(snapshot_done), snapshot_cost,
            float(step), float(step) ** 2,
        ],
        dtype=torch.float64,
    )  # fmt: skip
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    generation_sum, stop_sum, due_sum, loss_sum, reform_sum, done_sum, cost_sum, step_sum, square_sum = values.tolist()
    # The steps are equal iff their sum of squares is the square of their sum over W (exact in float64).
    same_step = step_sum * step_sum == square_sum * world_size
    return Boundary(
        int(generation_sum),
        stop_sum > 0,
        due_sum > 0,
        loss_sum / world_size,
        reform_sum > 0,
        round(done_sum) == world_size,
        cost_sum / world_size,
        same_step,
    )
