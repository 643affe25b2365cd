"""FSDP2 sharding of the built-in trainer's decoder over a world's device mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from regroup.trainer.config import ModelConfig
from regroup.trainer.model import Decoder


def build_sharded_model(cfg: ModelConfig, seed: int, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """The decoder, initialised identically on every rank, then sharded over ``mesh``: one
    FSDP unit per block and the root. On CUDA: bf16 compute with fp32 gradient reduction
    (params kept fp32)."""
    model = Decoder(cfg)
    model.init_weights(seed)
    is_cuda = device.type == "cuda"
    if is_cuda:
        model.to(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for index, block in enumerate(model.layers):
        if cfg.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            block = checkpoint_wrapper(block)
            model.layers[index] = block
        if cfg.compile and is_cuda:
            block.compile()
        # The last block's parameters are needed first in backward: no point resharding them.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
