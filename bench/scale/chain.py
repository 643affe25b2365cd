"""Every path that moves training state, one after the other, in the same processes.

``python -m bench.scale.chain SPEC PROC``: one of ``procs`` processes (SPEC is JSON, see
``ChainSpec``). They train the trainer's own Llama-style decoder (FSDP2 or DDP, gloo)
through a chain of worlds, each re-form one path of the in-place re-form as the trainer
takes it (``hold_state``, ``hand_off``, ``secure``, ``Snapshots``, ``redistribute``, ``Checkpointer``);
the last process is the one that comes and goes:

1. ``start``: all train; in-memory snapshots at every step (their cost measured);
2. ``replace``: the last process's node is lost without notice and a fresh process takes
   its position: the same world size, from the snapshots and buddy copies;
3. ``shrink-loss``: it is lost again, and the world goes on without it (from snapshots);
4. ``grow``: it joins fresh at an agreed boundary: the survivors' live state;
5. ``migrate``: it leaves with notice, hands its shards over, a spare takes its position;
6. ``shrink-planned``: it leaves with notice, its snapshots secured with the staying ranks
   first (``secure``, as at a planned shrink's ack); a DCP checkpoint is saved (sync, async);
7. ``load``: every process starts afresh and loads that checkpoint.

After each re-form every process records what it moved and how long that took, its
resident memory at the re-form's peak and after it, whether any model or optimizer tensor
holds a storage larger than its own bytes (``memory.storage_report``), and whether the
state it landed on is the state the old world left (a digest of every tensor). With
``floors``, the same bytes also go through the raw floor in the same run (``floors``).
Each process writes ``out/proc-P.json``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from bench.scale import floors, memory
from regroup.elastic.checkpoint.app_state import AppState, TrainerState
from regroup.elastic.checkpoint.checkpointer import Checkpointer
from regroup.elastic.checkpoint.folders import folder_bytes, step_dir
from regroup.elastic.memory import reshard
from regroup.elastic.memory.handoff import hand_off, secure
from regroup.elastic.memory.host_memory import give_back
from regroup.elastic.memory.reshard import HeldState, flat_state, forget_old_meshes, hold_state, redistribute, split_state
from regroup.elastic.memory.snapshot import Snapshots
from regroup.elastic.memory.snapshot_cost import interval_for
from regroup.elastic.settings import CheckpointConfig
from regroup.elastic.world.runtime import Runtime, runtime_on_default_group
from regroup.trainer.config import ModelConfig
from regroup.trainer.model import Decoder
from regroup.trainer.sharding import build_sharded_model

PATHS = ("replace", "shrink-loss", "grow", "migrate", "shrink-planned", "load")


@dataclass(frozen=True)
class ChainSpec:
    port: int
    """A TCPStore on loopback that the caller hosts."""
    procs: int
    wrap: str
    """``fsdp`` (FSDP2, one unit per block) or ``ddp``."""
    model: dict[str, int]
    """``ModelConfig`` fields."""
    out: str
    checkpoint_dir: str
    bucket_bytes: int = 0
    """``reshard.BUCKET_BYTES`` for the run (0: the default)."""
    batch: int = 2
    """Samples per rank per step."""
    steady_steps: int = 3
    """Steps per block timed at ``start``, without and with a snapshot at every step."""
    steady_rounds: int = 1
    """Blocks of each kind, in turn (a drift of the machine's speed hits both alike)."""
    floors: bool = False
    """Also time the raw floor of every path's bytes."""
    timeout_s: float = 600


@dataclass
class Record:
    """One process's view of one re-form (or of the steady state, ``start``)."""

    path: str
    member: bool
    old_world: int = 0
    world: int = 0
    step: int = -1
    seconds: float = 0.0
    """The state's move: ``redistribute`` (or the checkpoint's load), on this process."""
    transfer_s: float = 0.0
    received_bytes: int = 0
    sent_bytes: int = 0
    received_from: dict[int, int] = field(default_factory=dict)
    sent_to: dict[int, int] = field(default_factory=dict)
    state_bytes: int = 0
    """This rank's model + optimizer state after the re-form."""
    share_bytes: int = 0
    """This rank's share of the job's state (replicated tensors counted once per job)."""
    peak_rss: int = 0
    after_rss: int = 0
    live_tensor_bytes: int = 0
    """Every storage a live tensor of the process holds, after the re-form."""
    storage: dict[str, Any] = field(default_factory=dict)
    digest_ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Chain:
    def __init__(self, spec: ChainSpec, proc: int) -> None:
        self.spec, self.proc = spec, proc
        self.mover = spec.procs - 1
        self.timeout = timedelta(seconds=spec.timeout_s)
        self.store = dist.TCPStore("127.0.0.1", spec.port, is_master=False, timeout=self.timeout)
        self.cfg = ModelConfig(**spec.model)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.snaps: Snapshots | None = None
        self.rt: Runtime | None = None
        self.step = 0
        self.held: list[HeldState] = []
        self.digest: list[float] | None = None
        self.records: list[Record] = []
        self.baseline_rss = 0
        if spec.bucket_bytes:
            reshard.BUCKET_BYTES = spec.bucket_bytes

    # --- worlds -------------------------------------------------------------------------

    def join(self, name: str, members: list[int]) -> bool:
        """Enter world ``name`` if this process is one of ``members`` (its rank: its index)."""
        if self.proc not in members:
            return False
        forget_old_meshes()
        store = dist.PrefixStore(name, self.store)
        dist.init_process_group(
            "gloo", store=store, rank=members.index(self.proc), world_size=len(members), timeout=self.timeout
        )
        self.rt = runtime_on_default_group(0, torch.device("cpu"), self.timeout)
        return True

    def leave_world(self) -> None:
        if self.snaps is not None:
            self.snaps.close()
            self.snaps = None
        dist.barrier()  # nobody tears its pairs down while a peer still uses them (gloo)
        dist.destroy_process_group()
        self.rt = None

    def build(self) -> None:
        """A fresh model and optimizer for the current world (other weights than the state to restore)."""
        assert self.rt is not None
        if self.spec.wrap == "fsdp":
            model = build_sharded_model(self.cfg, 1000 + self.proc, self.rt.mesh, self.rt.device)
        else:
            plain = Decoder(self.cfg)
            plain.init_weights(1000 + self.proc)
            model = DistributedDataParallel(plain)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def drop(self) -> None:
        """Forget the model, the optimizer and their snapshots (a process that is lost, or a
        survivor whose old state is now held elsewhere)."""
        self.model = self.optimizer = None
        if self.snaps is not None:
            self.snaps.close()
            self.snaps = None

    # --- training -----------------------------------------------------------------------

    def train_step(self) -> float:
        assert self.model is not None and self.optimizer is not None and self.rt is not None
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(self.step * 1009 + self.rt.rank)
        tokens = torch.randint(0, self.cfg.vocab_size, (self.spec.batch, self.cfg.seq_len + 1), generator=generator)
        logits = self.model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        if self.snaps is not None:
            self.snaps.wait_copied()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return time.perf_counter() - started

    def snapshots(self) -> Snapshots:
        assert self.model is not None and self.optimizer is not None and self.rt is not None
        if self.snaps is None:
            # A node of its own per rank (buddies off-node), all on this machine: the memory
            # check counts every rank against this machine's memory.
            place = ("", f"node-{self.proc}")
            self.snaps = Snapshots(
                self.model, self.optimizer, self.rt.rank, self.rt.world_size, place, 1, self.timeout,
                ranks_on_node=self.spec.procs, max_every=1,
            )  # fmt: skip
        return self.snaps

    def _agree(self, flag: bool) -> bool:
        assert self.rt is not None
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.rt.control_group)
        return bool(value.item())

    def snapshot_now(self) -> tuple[float, float]:
        """At this boundary: take a snapshot and wait until every buddy holds it (committed).
        Returns (copy seconds, exchange seconds after the copy)."""
        snaps = self.snapshots()
        while not snaps.ready:  # the buffers are allocated in the background
            snaps.agreed(self._agree(snaps.done(self.step)), 0.0)
        t0 = time.perf_counter()
        snaps.take(self.step)
        snaps.wait_copied()
        t1 = time.perf_counter()
        assert snaps.in_flight is not None and snaps.in_flight.exchanged is not None
        snaps.in_flight.exchanged.result()
        t2 = time.perf_counter()
        snaps.agreed(self._agree(snaps.done(self.step)), 0.0)
        assert snaps.committed is not None and snaps.committed.step == self.step
        snaps.settled()
        return t1 - t0, t2 - t1

    def train_with_snapshots(self, steps: int) -> list[float]:
        """Steps as the loop runs them with a snapshot at every boundary (the copy overlaps
        the next step's forward and backward, the exchange runs on behind it)."""
        snaps = self.snapshots()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.train_step()
            if snaps.in_flight is not None and snaps.in_flight.exchanged is not None:
                snaps.in_flight.exchanged.result()  # ``every: 1``: the next one is due now
            snaps.agreed(self._agree(snaps.done(self.step)), 0.0)
            if snaps.due(self.step):
                snaps.take(self.step)
            snaps.settled()
            times.append(time.perf_counter() - started)
        if snaps.in_flight is not None and snaps.in_flight.exchanged is not None:
            snaps.in_flight.exchanged.result()
        snaps.agreed(self._agree(snaps.done(self.step)), 0.0)
        return times

    # --- what is checked after a re-form --------------------------------------------------

    def state_digest(self) -> list[float]:
        """Per tensor of the state, its sum and sum of squares over the whole job (a collective)."""
        assert self.model is not None and self.optimizer is not None and self.rt is not None
        state = split_state(flat_state(self.model, self.optimizer))
        values = []
        for key, tensor in sorted(state.tensors.items()):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            data = local.detach().double()
            share = 1.0 if key in state.sharded else 1.0 / self.rt.world_size  # replicated: counted once
            values += [float(data.sum()) * share, float((data * data).sum()) * share]
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total, group=self.rt.control_group)
        return total.tolist()

    def _digest_matches(self, before: list[float] | None) -> bool | None:
        after = self.state_digest()
        if before is None:
            return None
        return len(before) == len(after) and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6) for a, b in zip(before, after, strict=True))

    # --- the paths ------------------------------------------------------------------------

    def start(self, members: list[int]) -> Record:
        record = Record("start", self.join("start", members))
        self.baseline_rss = memory.rss()
        if not record.member:
            return record
        self.build()
        self.train_step()  # AdamW's state exists: snapshots can be laid out
        for _ in range(3):  # both generations' buffers in use: the last one is a steady snapshot
            copy_s, exchange_s = self.snapshot_now()
        memory.reset_peak()
        quiet: list[float] = []
        busy: list[float] = []
        for _ in range(self.spec.steady_rounds):
            quiet.append(statistics.mean(self.train_step() for _ in range(self.spec.steady_steps)))
            busy.append(statistics.mean(self.train_with_snapshots(self.spec.steady_steps)))
        record.peak_rss = memory.peak()
        record.after_rss = memory.rss()
        assert self.model is not None and self.optimizer is not None and self.snaps is not None
        record.state_bytes = memory.state_bytes(self.model, self.optimizer)
        record.share_bytes = memory.share_bytes(self.model, self.optimizer, self.rt.world_size)
        quiet_s, busy_s = statistics.median(quiet), statistics.median(busy)
        cost = max(0.0, busy_s - quiet_s) / quiet_s
        record.extra = {
            "baseline_rss": self.baseline_rss,
            "snapshot_host_bytes": self.snaps.host_bytes,
            "step_s": quiet_s,
            "step_with_snapshot_s": busy_s,
            "snapshot_cost_share": cost,
            "auto_wanted": interval_for(cost, 10**6).wanted,
            "snapshot_copy_s": copy_s,
            "snapshot_exchange_s": exchange_s,
            "snapshot_bytes": self.snaps.copy_bytes[0],
        }
        if self.spec.floors:
            assert self.rt is not None
            own, received = self.snaps.copy_bytes
            record.extra |= floors.snapshot(own, received, self.snaps.buddy, self.rt.rank)
        self.digest = self.state_digest()
        return record

    def reform(self, path: str, members: list[int], leave: str) -> Record:
        """Leave the current world the way ``leave`` says, join the next (``members``) and
        restore the state there; ``leave``: ``loss`` (the mover is lost; the others keep
        their snapshots), ``agreed`` (an agreed boundary: live state and snapshots),
        ``handoff`` (the mover hands its shards over there) or ``secured`` (it secures its
        snapshots first, and hands nothing over)."""
        memory.reset_peak()
        old_world = dist.get_world_size() if self.rt is not None else 0
        handoff_s = 0.0
        handed: dict[str, float] = {}
        if self.rt is not None:
            assert self.model is not None and self.optimizer is not None
            moving = self.proc == self.mover
            if leave == "loss":
                self.held = [] if moving else self.snapshots().held()
            else:
                own = hold_state(self.model, self.optimizer, self.rt.rank, self.rt.world_size, self.step)
                self.held = [] if moving else [own]
                if leave in ("handoff", "secured"):
                    t0 = time.perf_counter()
                    shards = sum(own.tensors[k].numel() * own.tensors[k].element_size() for k in own.sharded)
                    if leave == "secured":
                        done = secure(self.snapshots(), self.step, moving)
                        self.held += done.received  # kept there only
                        handed["secured_received_bytes"] = sum(t.nbytes for h in done.received for t in h.tensors.values())
                        total = torch.tensor([done.sent_bytes])  # told to all: the floor sends it in one message
                        dist.all_reduce(total, op=dist.ReduceOp.MAX)
                        shards = int(total.item())
                        del done
                    self.held = hand_off(own, leaving=moving, secured=leave == "secured") + self.held[1:]  # + secured
                    handoff_s = time.perf_counter() - t0
                    if moving:
                        handed["handoff_bytes"] = shards
                    if self.spec.floors:
                        # The mover is the old world's last rank; one donor goes to keeper 0.
                        handed |= floors.handoff(shards, self.rt.world_size - 1, 0, self.rt.rank)
                if not moving:
                    self.held += self.snapshots().held()
                del own  # what is kept is in ``self.held``
            if moving:
                self.held = []
            self.leave_world()
            self.drop()
        record = Record(path, self.join(path, members), old_world)
        record.extra |= {"handoff_s": handoff_s, **handed}
        if not record.member:
            self.held = []
            self.digest = None
            return record
        assert self.rt is not None
        record.world = self.rt.world_size
        self.build()
        assert self.model is not None and self.optimizer is not None
        t0 = time.perf_counter()
        record.step = redistribute(self.model, self.optimizer, self.held or None, dist.group.WORLD)
        record.seconds = time.perf_counter() - t0
        moved = reshard.last_moved()
        assert moved is not None
        record.transfer_s, record.received_bytes, record.sent_bytes = moved.transfer_s, moved.received_bytes, moved.sent_bytes
        record.received_from, record.sent_to = moved.received_from, moved.sent_to
        record.extra["copied_bytes"] = moved.copied_bytes
        self.held = []
        self.step = record.step
        self._after(record)
        if self.spec.floors:
            record.extra |= floors.pairs(moved.received_from, moved.sent_to, moved.copied_bytes)
        return record

    def _after(self, record: Record) -> None:
        """What every re-form records: its peak through the restore, the restored tensors
        and state; then, as the run does, the new world's first step and what it gives back
        at that boundary (``host_memory.give_back``), and what the process holds after."""
        assert self.model is not None and self.optimizer is not None and self.rt is not None
        record.peak_rss = memory.peak()
        record.storage = memory.storage_report(self.model, self.optimizer)
        record.digest_ok = self._digest_matches(self.digest)
        record.state_bytes = memory.state_bytes(self.model, self.optimizer)
        record.share_bytes = memory.share_bytes(self.model, self.optimizer, self.rt.world_size)
        self.train_step()
        give_back()
        record.after_rss = memory.rss()
        record.live_tensor_bytes = memory.live_tensor_bytes()

    def settle(self) -> None:
        """After a re-form: a committed snapshot, as the next world's steady state."""
        if self.rt is None:
            return
        self.snapshot_now()
        self.digest = self.state_digest()

    def save(self) -> dict[str, Any]:
        """A DCP checkpoint of the current state: sync, then async (the host copy staged)."""
        assert self.model is not None and self.optimizer is not None and self.rt is not None
        root = Path(self.spec.checkpoint_dir)
        trainer = TrainerState()
        trainer.step = self.step
        app = AppState(self.model, self.optimizer, trainer)
        checkpointer = Checkpointer(CheckpointConfig(dir=str(root), keep_last=2, async_save=False), self.rt)
        checkpointer.prepare()
        memory.reset_peak()
        before = memory.rss()
        t0 = time.perf_counter()
        checkpointer.save(app, self.step, use_async=False)
        save_s = time.perf_counter() - t0
        sync_peak = memory.peak() - before
        nbytes = folder_bytes(step_dir(root, self.step))
        self.train_step()
        trainer.step = self.step
        memory.reset_peak()
        before = memory.rss()
        t0 = time.perf_counter()
        checkpointer.save(app, self.step, use_async=True)
        checkpointer.wait_staged()
        staged_s = time.perf_counter() - t0
        checkpointer.finish()
        async_s = time.perf_counter() - t0
        async_peak = memory.peak() - before
        checkpointer.close()
        self.digest = self.state_digest()
        result = {
            "save_s": save_s, "async_staged_s": staged_s, "async_save_s": async_s,
            "checkpoint_bytes": nbytes, "sync_save_extra_rss": sync_peak, "async_save_extra_rss": async_peak,
        }  # fmt: skip
        if self.spec.floors:
            result |= floors.files(nbytes // self.rt.world_size, root / "floor", self.rt.rank)
        return result

    def load(self, members: list[int]) -> Record:
        """Every process starts afresh and loads the newest committed checkpoint."""
        memory.reset_peak()
        old_world = dist.get_world_size() if self.rt is not None else 0
        if self.rt is not None:
            self.leave_world()
        self.drop()
        record = Record("load", self.join("load", members), old_world)
        if not record.member:
            return record
        assert self.rt is not None
        record.world = self.rt.world_size
        self.build()
        assert self.model is not None and self.optimizer is not None
        trainer = TrainerState()
        app = AppState(self.model, self.optimizer, trainer)
        checkpointer = Checkpointer(CheckpointConfig(dir=self.spec.checkpoint_dir), self.rt)
        checkpointer.prepare()
        t0 = time.perf_counter()
        step = checkpointer.load_latest(app)
        record.seconds = time.perf_counter() - t0
        record.step = -1 if step is None else step
        self.step = trainer.step
        checkpointer.close()
        self._after(record)
        return record

    def run(self) -> list[Record]:
        everyone = list(range(self.spec.procs))
        survivors = everyone[:-1]
        self.records.append(self.start(everyone))
        self.records.append(self.reform("replace", everyone, "loss"))
        self.settle()
        self.records.append(self.reform("shrink-loss", survivors, "loss"))
        self.settle()
        self.records.append(self.reform("grow", everyone, "agreed"))
        self.settle()
        self.records.append(self.reform("migrate", everyone, "handoff"))
        self.settle()
        self.records.append(self.reform("shrink-planned", survivors, "secured"))
        saved: dict[str, Any] = {}
        if self.rt is not None:
            self.train_step()
            saved = self.save()
        self.records.append(self.load(everyone))
        self.records[-1].extra |= saved
        self.leave_world()
        return self.records


def main(spec: ChainSpec, proc: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    records = Chain(spec, proc).run()
    Path(spec.out, f"proc-{proc}.json").write_text(json.dumps([asdict(r) for r in records]))


if __name__ == "__main__":
    main(ChainSpec(**json.loads(sys.argv[1])), int(sys.argv[2]))
