"""What a checkpoint holds: the model and optimizer (sharded DTensors), the run's position
and the user's small registered state (scheduler, extras), as one DCP ``Stateful``."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


class TrainerState(Stateful):
    """Position of the run: the step, samples seen, and the RNG, saved with the model."""

    def __init__(self) -> None:
        self.step = 0
        self.samples_seen = 0
        self.lr = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "lr": self.lr, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.lr = float(state["lr"])
        torch.set_rng_state(state["rng"])


def _tensor_identity(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Every parameter and buffer (object and memory) and the optimizer's state object of
    each parameter: what a kept ``get_state_dict`` result aliases."""
    with torch.no_grad():  # DTensor.to_local is then a plain attribute read
        tensors = tuple(
            (id(t), (t.to_local() if isinstance(t, DTensor) else t).data_ptr())
            for t in chain(model.parameters(), model.buffers())
        )
    groups = tuple(len(g["params"]) for g in optimizer.param_groups)
    optim = tuple((id(p), id(optimizer.state.get(p))) for g in optimizer.param_groups for p in g["params"])
    return tensors, groups, optim


@dataclass(frozen=True)
class _KeptState:
    """A ``get_state_dict`` result kept between saves. Its model tensors are detached views of
    the parameters' memory and its optimizer entries are the optimizer's own per-parameter
    state dicts, so in-place updates (the optimizer step) keep it current; only the param
    groups' settings (the learning rate) are read afresh at each save."""

    identity: tuple[Any, ...]
    model: dict[str, Any]
    optim_state: dict[str, Any]
    group_fqns: list[list[str]]
    """The parameters of each param group, as FQNs, in the optimizer's order."""
    keep_alive: tuple[Any, ...]
    """The objects ``identity`` names by ``id``, so no id is reused while this is kept."""


class AppState(Stateful):
    """Model + optimizer (sharded DTensors) + trainer state + the carried small state
    (``carried``: name -> Stateful, e.g. the LR scheduler), as one DCP state."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer: TrainerState,
        carried: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.trainer = trainer
        self.carried = dict(carried or {})
        self._kept: _KeptState | None = None

    def state_dict(self) -> dict[str, Any]:
        """The state as DCP saves it: references to the live tensors, no copy. Building it
        with ``get_state_dict`` costs milliseconds of Python on the training thread (FQN
        maps, module traversal), so the result is reused while no parameter, buffer or
        optimizer state object has been replaced (a load, a re-pad, a new optimizer)."""
        kept = self._kept
        if kept is None or kept.identity != _tensor_identity(self.model, self.optimizer):
            kept = self._keep()
        groups = [
            {**group, "params": list(fqns)}
            for group, fqns in zip(self.optimizer.state_dict()["param_groups"], kept.group_fqns, strict=True)
        ]
        optim = {"state": dict(kept.optim_state), "param_groups": groups}
        state = {"model": dict(kept.model), "optim": optim, "trainer": self.trainer.state_dict()}
        if self.carried:
            state["carried"] = {name: value.state_dict() for name, value in self.carried.items()}
        return state

    def _keep(self) -> _KeptState:
        # get_state_dict also creates optimizer state templates, which loading needs; the
        # identity is taken after it, once that state exists.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        identity = _tensor_identity(self.model, self.optimizer)
        keep_alive = (
            *chain(self.model.parameters(), self.model.buffers()),
            *(self.optimizer.state.get(p) for g in self.optimizer.param_groups for p in g["params"]),
        )
        self._kept = _KeptState(
            identity=identity,
            model=model_state,
            optim_state=optim_state["state"],
            group_fqns=[list(group["params"]) for group in optim_state["param_groups"]],
            keep_alive=keep_alive,
        )
        return self._kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kept = None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.trainer.load_state_dict(state["trainer"])
        for name, value in self.carried.items():
            value.load_state_dict(state["carried"][name])
        self._kept = None  # the optimizer's state objects were replaced
