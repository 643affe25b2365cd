"""What a job's size costs at a re-form, on paper: ``regroup whatif --params``.

The state-moving paths measured by ``bench scale`` (docs/benchmarks.md, "Sizes users
train") are priced for a model of ``params`` parameters on ``nodes`` x ``gpus`` GPUs: every
path's time is its bytes over a published bandwidth (a PCIe gen5 x16 host copy, a
400 Gb/s fabric per GPU, a node's NVMe), times how close to its raw floor the path ran
when measured (``EFFICIENCY``), plus what a re-form costs besides moving state
(``fixed``: the rendezvous, the process groups, the first step's start). Memory follows
the factors the trainer states and its tests assert: host memory for the snapshots (4x a
GPU's share of the state) and an async checkpoint's staging (one share); a re-form's peak
adds the next world's state on the GPU, beside the one it is built from.

A model, not a measurement: it leaves out the step's own traffic competing with a
snapshot's exchange (priced here as if nothing else used the link: the cost share is an
upper bound where the two contend), and stragglers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from regroup.whatif.churn import WhatIfError

GB = 1e9

EFFICIENCY = {
    "snapshot_copy": 0.71,
    "snapshot_exchange": 1.0,
    "handoff": 1.0,
    "reshard_same": 1.0,
    "reshard_changed": 0.84,
    "dcp_save": 1.0,
}
"""A path's rate over its raw floor's, as ``make bench ARGS="scale"`` measured it at its
largest size (FSDP2, 134M parameters, 1.6 GB of state, 4 ranks on gloo, 2026-11-28; the
slower of the paths that share a key; capped at 1, the floor): the share of a link's
bandwidth the path gets. The same share is assumed of the published bandwidths; NCCL's
sends and a GPU's copies are not measured here (no GPU was lent to that run)."""


@dataclass(frozen=True)
class Hardware:
    """Published bandwidths, per GPU unless named per node."""

    host_copy_gbps: float = 50.0
    """A device-to-host copy into pinned memory: PCIe gen5 x16 (64 GB/s raw, about 50 in practice)."""
    fabric_gbps: float = 50.0
    """One GPU's share of the scale-out network: 400 Gb/s (InfiniBand NDR, EFA, RoCE)."""
    storage_gbps: float = 10.0
    """A node's checkpoint writes: local NVMe (two PCIe gen4 drives)."""
    gpu_flops: float = 989e12
    """Dense bf16 FLOP/s (H100 SXM)."""


@dataclass(frozen=True)
class SizedJob:
    """A model and the GPUs it trains on."""

    params: float
    nodes: int
    gpus_per_node: int = 8
    bytes_per_param: float = 12.0
    """Model + optimizer state per parameter: fp32 parameters (FSDP2 keeps them, whatever the
    compute dtype) and AdamW's two moments."""
    tokens_per_step: float = 4e6
    mfu: float = 0.40
    fixed_s: float = 2.0
    """What a re-form costs besides moving state: rendezvous, process groups, first step."""
    detect_s: float = 0.5
    """From a node's death to the re-form starting (a pod's container status: 0.1 s; a
    silent node: its member lease)."""

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise WhatIfError("--params: must be positive")
        if self.nodes < 2:
            raise WhatIfError("--nodes: a job that re-forms needs at least 2 nodes")
        if self.gpus_per_node < 1:
            raise WhatIfError("--gpus-per-node: must be >= 1")
        if not 0 < self.mfu <= 1:
            raise WhatIfError("--mfu: must be in (0, 1]")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def share(self, nodes: int | None = None) -> float:
        """One GPU's bytes of the state (FSDP2 over every GPU of ``nodes`` nodes)."""
        return self.bytes_per_param * self.params / ((nodes or self.nodes) * self.gpus_per_node)


@dataclass(frozen=True)
class Projection:
    """What ``SizedJob`` costs on ``Hardware``: seconds, bytes and the interval ``auto`` picks."""

    state_per_gpu: float
    step_s: float
    snapshot_copy_s: float
    snapshot_exchange_s: float
    snapshot_cost_share: float
    """Of a step, were the copy and the exchange to slow it by their whole time (the bound)."""
    auto_every: int
    """The interval ``every: auto`` would choose with ``max_every`` no limit (2% of a step)."""
    host_per_node: float
    """Host memory of a node's GPUs: their snapshots (4x a share) and an async checkpoint's
    staging (one share)."""
    device_reform: float
    """GPU memory a re-form adds at its peak: the next world's state while this one's is held."""
    reclaim_s: float
    """Planned shrink: the leaving node's hand-off, the reshard to one node fewer."""
    migrate_s: float
    """Planned leave to a spare: the hand-off, then the same bytes on to the spare."""
    loss_s: float
    """Unplanned loss: detection, then the reshard from snapshots to one node fewer."""
    replace_s: float
    """Unplanned loss with a spare: detection, then the lost node's shards to the spare."""
    grow_s: float
    """One node joins: every rank's new shard, mostly from its neighbours."""
    checkpoint_s: float
    """A sync DCP save of a node's shards to its storage (an async one stalls for the copy only)."""


def project(job: SizedJob, hw: Hardware = Hardware()) -> Projection:
    share, fewer = job.share(), job.share(job.nodes - 1)
    fabric = hw.fabric_gbps * GB
    copy_s = share / (hw.host_copy_gbps * GB * EFFICIENCY["snapshot_copy"])
    exchange_s = share / (fabric * EFFICIENCY["snapshot_exchange"])
    step_s = 6 * job.params * job.tokens_per_step / (job.gpus * hw.gpu_flops * job.mfu)
    cost = (copy_s + exchange_s) / step_s
    handoff_s = share / (fabric * EFFICIENCY["handoff"])
    # One node fewer: a rank's new chunk overlaps its old one less the further along it is;
    # the last receives nearly all of its new chunk.
    shrink_s = fewer / (fabric * EFFICIENCY["reshard_changed"])
    same_s = share / (fabric * EFFICIENCY["reshard_same"])
    # From snapshots, the shards come out of host memory onto the GPU first.
    restore_s = share / (hw.host_copy_gbps * GB * EFFICIENCY["snapshot_copy"])
    return Projection(
        state_per_gpu=share,
        step_s=step_s,
        snapshot_copy_s=copy_s,
        snapshot_exchange_s=exchange_s,
        snapshot_cost_share=cost,
        auto_every=max(1, math.ceil(cost / 0.02 - 1e-9)),
        host_per_node=job.gpus_per_node * (4 + 1) * share,
        device_reform=fewer,
        reclaim_s=job.fixed_s + handoff_s + shrink_s,
        migrate_s=job.fixed_s + handoff_s + same_s,
        loss_s=job.detect_s + job.fixed_s + restore_s + shrink_s,
        replace_s=job.detect_s + job.fixed_s + restore_s + same_s,
        grow_s=job.fixed_s + share / (fabric * EFFICIENCY["reshard_changed"]),
        checkpoint_s=job.gpus_per_node * share / (hw.storage_gbps * GB * EFFICIENCY["dcp_save"]),
    )


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*$")


def parse_count(text: str, option: str) -> float:
    """``7B``, ``350M``, ``1.5e9``: a count of parameters or tokens."""
    match = _SIZE.match(text)
    if not match:
        raise WhatIfError(f"{option}: expected a number like 7B, 350M or 1.5e9, got {text!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    return float(match.group(1)) * scale


def _bytes(n: float) -> str:
    return f"{n / GB:.2f} GB" if n < 100 * GB else f"{n / GB:.0f} GB"


def format_projection(job: SizedJob, hw: Hardware, p: Projection) -> str:
    """The projection as the lines ``regroup whatif --params`` prints."""
    rows = [
        ("model + optimizer state per GPU", _bytes(p.state_per_gpu)),
        ("step (6 x params x tokens / (GPUs x FLOP/s x MFU))", f"{p.step_s:.2f} s"),
        ("snapshot: copy to host", f"{p.snapshot_copy_s:.3f} s"),
        ("snapshot: exchange with the buddy", f"{p.snapshot_exchange_s:.3f} s"),
        ("snapshot cost per step, at most", f"{p.snapshot_cost_share:.1%}"),
        ("every: auto would take one every", f"{p.auto_every} step{'s' * (p.auto_every != 1)} (at most snapshot.max_every: 1 by default)"),
        ("host memory per node: snapshots and async staging", _bytes(p.host_per_node)),
        ("GPU memory a re-form adds, at its peak", _bytes(p.device_reform)),
        ("planned reclaim (hand-off, one node fewer)", f"{p.reclaim_s:.1f} s"),
        ("planned leave to a spare (migrate)", f"{p.migrate_s:.1f} s"),
        ("node lost, no spare (from snapshots)", f"{p.loss_s:.1f} s"),
        ("node lost, a spare takes its place", f"{p.replace_s:.1f} s"),
        ("grow by one node", f"{p.grow_s:.1f} s"),
        ("sync DCP save to local NVMe", f"{p.checkpoint_s:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    head = (
        f"regroup whatif: {job.params / 1e9:g}B parameters on {job.nodes} x {job.gpus_per_node} GPUs "
        f"({job.bytes_per_param:g} bytes of state per parameter, {job.tokens_per_step / 1e6:g}M tokens a step "
        f"at {job.mfu:.0%} MFU); host copy {hw.host_copy_gbps:g} GB/s, fabric {hw.fabric_gbps:g} GB/s per GPU, "
        f"storage {hw.storage_gbps:g} GB/s per node; each path at its measured share of the link "
        f"(bench scale); re-forms include {job.fixed_s:g} s besides moving state"
    )
    return "\n".join([head, "", *(f"{name:<{width}}  {value}" for name, value in rows)])
