"""A ``Run``'s epochs and loaders: ``for epoch in run.epochs(): for batch in
run.batches(loader):`` (a part of ``regroup.elastic.Run``). The epoch and the position in it
follow from the step, so a re-form of any size goes on from the very next sample."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from regroup.elastic.data import Sampler, Span, fit_batches, sampler_of
from regroup.elastic.randomness import enter_samples
from regroup.elastic.state import MisuseError
from regroup.elastic.step import set_gradient_sync

if TYPE_CHECKING:
    from torch import nn

    from regroup.elastic.checkpoint.app_state import TrainerState
    from regroup.elastic.options import Options
    from regroup.elastic.world.batching import BatchPlan


class Epochs:
    """Epochs of the loader's dataset, and the loader's batches step by step."""

    cfg: Options
    state: TrainerState
    plan: BatchPlan
    model: nn.Module
    sampler: Sampler | None
    _epoch: int | None

    def epochs(self) -> Iterator[int]:
        """The epochs left to train, from the one the run is in (``Run(data=loader,
        epochs=N)``); train each with ``run.batches(loader)``."""
        per_epoch = self._steps_per_epoch("run.epochs()")
        self._start("run.epochs() is iterated once, around `run.batches(loader)`")
        try:
            while self._finish_step() and self.state.step < self.cfg.max_steps:
                epoch = self.state.step // per_epoch
                self._epoch = epoch
                yield epoch
                if self.state.step < min((epoch + 1) * per_epoch, self.cfg.max_steps) and not self._over():
                    raise MisuseError(
                        f"epoch {epoch} ended at step {self.state.step}, before its last step: "
                        "train every batch of `run.batches(loader)` on every rank"
                    )
            self._next_step()  # the end: the last save and the final barrier
        finally:
            self._epoch = None
            self._end_iteration()

    def batches(self, loader: Any) -> Iterator[Any]:
        """``for batch in run.batches(loader):`` this rank's batches from a loader that
        draws from an ``elastic.Sampler``, one per micro-batch (``run.current``: its
        ``Step``; ``run.report(loss)``; with micro-batches, step the optimizer after the
        one where ``run.current.last_micro``). Inside ``run.epochs()``: the rest of that
        epoch; alone: every step left. Asking for a step's first batch is its boundary, as
        in ``for step in run:``."""
        sampler = sampler_of(loader)
        if self.sampler is not None and sampler is not self.sampler:
            raise MisuseError("run.batches(loader): the loader draws from another Sampler than Run(data=...)'s")
        per_epoch = sampler.steps_per_epoch(self.plan.global_batch)
        alone = self._epoch is None
        if alone:
            self._start("run.batches(loader) outside run.epochs() is iterated once")
        try:
            while self._finish_step() and self.state.step < self.cfg.max_steps:
                epoch = self.state.step // per_epoch if alone else self._epoch
                end = min((epoch + 1) * per_epoch, self.cfg.max_steps)
                if self.state.step >= end:
                    return
                sampler.cover(Span(self.plan, self.state.step, end, per_epoch))
                fit_batches(loader, self.plan.micro_batch)
                batches = iter(loader)
                try:
                    while self._finish_step() and self.state.step < end:
                        step = self._begin_step()
                        count = self.plan.accumulation
                        ids = sampler.batches(Span(self.plan, step.index, step.index + 1, per_epoch))
                        step.loaded = True
                        for micro, (_, sample_ids) in enumerate(ids):
                            step.micro = micro
                            set_gradient_sync(self.model, micro == count - 1)
                            enter_samples(sample_ids)
                            yield next(batches)
                        set_gradient_sync(self.model, True)
                finally:
                    sampler.cover(None)
                if not alone:
                    return
            if alone:
                self._next_step()  # the end: the last save and the final barrier
        finally:
            if alone:
                self._end_iteration()

    def _steps_per_epoch(self, what: str) -> int:
        if self.sampler is None:
            raise MisuseError(f"{what} needs Run(data=loader, epochs=N): the loader's elastic.Sampler counts them")
        return self.sampler.steps_per_epoch(self.plan.global_batch)

    def epoch_of(self, step: int) -> int:
        """The epoch step ``step`` is in (0 without ``data=``)."""
        return step // self.sampler.steps_per_epoch(self.plan.global_batch) if self.sampler is not None else 0
