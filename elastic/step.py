"""``Step``: one optimizer step of a ``Run``: which global samples this rank trains, in
which micro-batches, and the loss it reports."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from regroup.elastic.randomness import enter_samples
from regroup.elastic.state import World

if TYPE_CHECKING:
    from regroup.elastic.run import Run


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Reduce gradients across ranks only on a step's last micro-batch (FSDP2, DDP; also
    under ``torch.compile(model)``, whose ``_orig_mod`` is the wrapped model)."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = sync


class Step:
    """One optimizer step of the run: which samples this rank trains on, and its loss."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self.index = run.state.step
        """The step being trained, counted from 0 (it completes as step ``index + 1``)."""
        self.world: World = run.world_info
        self._plan = run.plan
        self._loss: float | None = None
        self._tokens = 0
        self.micro = 0
        """With a loader (``run.batches``): the micro-batch being trained, from 0."""
        self.loaded = False
        """Its batches come from ``run.batches(loader)``."""
        self._started = time.perf_counter()

    @property
    def epoch(self) -> int:
        """The epoch this step is in (with ``Run(data=..., epochs=...)``; else 0)."""
        return self._run.epoch_of(self.index)

    @property
    def last_micro(self) -> bool:
        """With a loader: this is the step's last micro-batch (step the optimizer after it)."""
        return self.micro == self._plan.accumulation - 1

    @property
    def accumulation(self) -> int:
        """Micro-batches this rank runs in this step: divide each micro-batch's mean loss by it."""
        return self._plan.accumulation

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch on this rank."""
        return self._plan.micro_batch

    @property
    def ids(self) -> range:
        """Global sample ids this rank trains on in this step (all its micro-batches): step
        ``s`` trains the global samples ``[s*G, (s+1)*G)`` at any world size."""
        return self._plan.step_ids(self.index)

    @property
    def local(self) -> slice:
        """This rank's share of the step's global batch, as a slice of it (``batch[step.local]``)."""
        start = self._plan.rank * self._plan.per_rank
        return slice(start, start + self._plan.per_rank)

    def micro_batches(self) -> Iterator[range]:
        """This rank's global sample ids, micro-batch by micro-batch; gradients are reduced
        across ranks on the last micro-batch only (FSDP2 and DDP models)."""
        self._run._check_current(self, "step.micro_batches()")
        model, count = self._run.model, self._plan.accumulation
        try:
            for micro in range(count):
                set_gradient_sync(model, micro == count - 1)
                ids = self._plan.micro_batch_ids(self.index, micro)
                enter_samples(ids)
                yield ids
        finally:
            set_gradient_sync(model, True)

    def report(self, loss: float | torch.Tensor, tokens: int = 0) -> None:
        """This rank's loss for the step (its mean over its samples); ``tokens``: tokens this
        rank trained on in the step, for the tokens/s in progress (0: samples/s only)."""
        self._run._check_current(self, "step.report()")
        self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._tokens = tokens
