"""Where a rank runs and the groups it talks through: the default process group, the device
mesh, and gloo side groups for async checkpoint writes and the per-step agreement."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from regroup.rendezvous.inplace.formation import side_group
from regroup.elastic.memory.reshard import forget_old_meshes


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs and the groups it talks through."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    checkpoint_group: dist.ProcessGroup
    """A separate gloo group for async checkpoint writes, so their collectives run in a
    background thread without interleaving with training collectives."""
    control_group: dist.ProcessGroup
    """A gloo group for the per-step agreement (a CPU tensor, no device sync)."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but CUDA is not available")
    if preference in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    # CPU collectives must exist on CUDA too: async DCP save and the agreement run on gloo.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_runtime(env: Mapping[str, str], device_preference: str, timeout: timedelta) -> Runtime:
    """Initialise the default process group from torchrun's env (or a world of one)."""
    rank = int(env.get("RANK", "0"))
    world_size = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    backend = backend_for(device)
    if "MASTER_ADDR" in env:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return runtime_on_default_group(local_rank, device, timeout)


def runtime_on_default_group(local_rank: int, device: torch.device, timeout: timedelta) -> Runtime:
    """The mesh and side groups over the current default process group (after a first
    ``init_process_group`` or an in-place re-form)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # DTensor caches sharding specs by mesh, and equal meshes of an earlier world carry this
    # process's old coordinate (torch 2.13): forget them before sharding anew.
    forget_old_meshes()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    checkpoint_group = side_group(timeout)
    control_group = side_group(timeout)
    return Runtime(rank, world_size, local_rank, device, mesh, checkpoint_group, control_group)
