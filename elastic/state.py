"""The world a script trains in (``World``) and the state a run keeps for it (``State``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class MisuseError(RuntimeError):
    """The API was called in a way that cannot work; the message says what to do instead."""


@dataclass(frozen=True)
class World:
    """The world this process trains in now. A new one is made at every re-form."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    """Where this rank computes: ``cuda:<local_rank>`` on GPU nodes, else the CPU."""
    mesh: DeviceMesh
    """A 1-D mesh named ``dp`` over the whole world: pass it to ``fully_shard(mesh=...)``."""
    round: int = 0
    """The rendezvous round that formed this world (0 outside ``regroup-run``)."""
    restart_count: int = 0
    """torchrun's restart count of this process's incarnation."""


@dataclass
class State:
    """The state a run keeps for the script across checkpoints, snapshots and re-forms
    (``Run``'s arguments).

    ``model`` and ``optimizer`` are sharded (FSDP2), replicated (DDP) or local (one rank);
    they are saved with DCP, kept in the in-memory snapshots and re-cut in memory for a new
    world. ``scheduler`` and ``extras`` (any objects with ``state_dict``/``load_state_dict``,
    e.g. a data loader's position, an EMA, counters) are small and the same on every rank:
    they are saved with DCP and, on an in-memory re-form, copied from a surviving rank."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise MisuseError(f"Run(model, ...): model must be a torch.nn.Module, not {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise MisuseError(
                f"Run(model, optimizer, ...): optimizer must be a torch.optim.Optimizer, "
                f"not {type(self.optimizer).__name__}"
            )
        for name, value in self.carried().items():
            if _splits_by_rank(value):
                raise MisuseError(
                    f"Run extras {name!r}: a DistributedSampler splits the data by rank and world size, so "
                    "its order changes when the world does; index your data by step.micro_batches() instead"
                )
            if not (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))):
                raise MisuseError(
                    f"Run extras {name!r}: {type(value).__name__} has no state_dict()/load_state_dict(); "
                    "register only objects whose state can be saved (torch.distributed.checkpoint.Stateful)"
                )

    def carried(self) -> dict[str, Any]:
        """The small replicated state by name: the scheduler and the extras."""
        carried = dict(self.extras)
        if self.scheduler is not None:
            if "scheduler" in carried:
                raise MisuseError("Run extras must not use the name 'scheduler' (the scheduler= argument holds it)")
            carried["scheduler"] = self.scheduler
        return carried

    def carried_state(self) -> dict[str, Any]:
        """A copy of the small state, safe to keep while training goes on."""
        return {name: copy.deepcopy(value.state_dict()) for name, value in self.carried().items()}

    def load_carried(self, saved: Mapping[str, Any]) -> None:
        carried = self.carried()
        missing = sorted(set(carried) - set(saved))
        if missing:
            raise ValueError(f"the saved state has no {', '.join(missing)}")
        for name, value in carried.items():
            value.load_state_dict(copy.deepcopy(saved[name]))


def _splits_by_rank(value: Any) -> bool:
    """A ``DistributedSampler``, or a data loader drawing from one."""
    from torch.utils.data import DistributedSampler

    return isinstance(value, DistributedSampler) or isinstance(getattr(value, "sampler", None), DistributedSampler)
