"""Pretrain a small Llama (Hugging Face transformers) with FSDP2 on synthetic tokens.

    torchrun --nproc-per-node 4 upstream.py --steps 200

The model is built from a LlamaConfig: no weights are downloaded. Every rank trains an
equal share of each global batch, in micro-batches with gradient accumulation.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: nothing to fetch

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from regroup import elastic

parser = argparse.ArgumentParser(description="Llama + FSDP2 on synthetic tokens")
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step")
parser.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward")
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--vocab", type=int, default=1024)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()

config = LlamaConfig(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    intermediate_size=4 * args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=args.seq_len,
)


def sample(i):
    """Training sample i: tokens in an arithmetic progression (mod the vocabulary) whose
    start and stride are drawn from i. A stand-in for a tokenized corpus, and learnable."""
    start, stride = torch.randint(0, args.vocab, (2,), generator=torch.Generator().manual_seed(i)).tolist()
    return (start + stride * torch.arange(args.seq_len)) % args.vocab


def build(mesh, device):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer


def train_step(model, optimizer, micro_batches, device):
    """One optimizer step over this rank's micro-batches; returns its mean loss."""
    total = 0.0
    for n, ids in enumerate(micro_batches):
        model.set_requires_gradient_sync(n == len(micro_batches) - 1)
        x = torch.stack([sample(i) for i in ids]).to(device)
        loss = model(input_ids=x, labels=x).loss / len(micro_batches)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    return total


@elastic.in_place
def main():
    device = elastic.world().device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(init_device_mesh(device.type, (world_size,)), device)
    share = args.global_batch // world_size  # step s trains samples [s * global_batch, (s + 1) * global_batch)
    for s in elastic.Run(model, optimizer, global_batch=args.global_batch, max_steps=args.steps, snapshot_every=1):
        step = s.index
        first = step * args.global_batch + rank * share
        micro_batches = [range(i, min(i + args.micro_batch, first + share)) for i in range(first, first + share, args.micro_batch)]
        loss = train_step(model, optimizer, micro_batches, device)
        s.report(loss)
        if rank == 0:
            print(f"step {step + 1} loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
