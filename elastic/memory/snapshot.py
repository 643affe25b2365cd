"""In-memory snapshots of every rank's shards, each with a copy on a buddy rank of another node.

Every K steps, at the agreed step boundary, each rank copies its model and optimizer shards
(the state a DCP checkpoint holds) into host memory, and a background thread sends that
copy to its *buddy* while the next step computes; the rank receives the copy of the rank
whose buddy it is. When a node dies without notice, the survivors hold, between their own
snapshots and their buddies' copies, every old rank's shards at one step, and rebuild the
new world's sharding from memory (``regroup.elastic.memory.reshard.redistribute``): at most
``max_every`` steps are lost instead of everything since the last committed checkpoint.

Consistency follows the rule of ``COMMITTED`` for storage: a generation (the snapshots of
one step) counts once every rank has copied and exchanged it, which the ranks learn at a
step boundary (``Boundary.snapshot_done``). Until then the previous generation is kept, so
a node lost while its copy is on the wire leaves the one before to recover from. Host
memory: two generations of this rank's copy and two of its sender's, 4x the rank's share
of the job's model + optimizer state. Replicated state (DDP's whole state, AdamW's
``step``) is the same on every rank, so each rank copies only its flat chunk of it: the
job keeps it once, split over the ranks, and a rank's buddy holds that chunk's copy as it
holds a shard's. A DDP rank's snapshots are 4/W of its state, not 4x.

The lost-step bound: after exchanging a generation the ranks learn, with one small
all-reduce on the snapshots' own thread, that every buddy holds its copy; a step counts as
done (``before_step_counts``, before the loop's count, the sample log and progress move)
only once a generation at most ``max_every`` steps older is known to be held that way. So
whichever node is lost, and however late a loaded machine ran the exchange, the survivors
hold a step no more than ``max_every`` behind the newest step any rank counted.

A rank and its buddy are on different nodes, and in different failure domains when the
ranks know theirs (``REGROUP_FAILURE_DOMAIN``, else the node's zone, ``REGROUP_ZONE``, which
the topology init container exports).

The buffers' layout and the choice of buddies are ``regroup.elastic.memory.snapshot_layout``; the memory
check and the measured cost behind ``every: auto`` are ``regroup.elastic.memory.snapshot_cost``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from regroup.rendezvous.inplace.formation import side_group
from regroup.elastic.settings import ConfigError
from regroup.elastic.memory.reshard import CHUNK, HeldState, flat_state, split_state
from regroup.elastic.memory.reshard_plan import flat_span
from regroup.elastic.memory.snapshot_cost import (
    SNAPSHOT_COPIES,
    CostMeter,
    Interval,
    SnapshotMemoryError,
    interval_for,
    memory_refusal,
    share_bytes,
)
from regroup.elastic.memory.snapshot_layout import STAMP, Layout, buddies, layout_for, setting_keys

log = structlog.get_logger("regroup.trainer.snapshot")

GENERATIONS = 2
"""Buffers per side: the newest complete generation and the one being made."""
assert SNAPSHOT_COPIES == 2 * GENERATIONS  # own and received, each GENERATIONS deep


@dataclass
class Generation:
    """The snapshots of one step: this rank's copy and the copy received from its sender."""

    step: int
    slot: int
    copied: threading.Event = field(default_factory=threading.Event)
    """Set when the copy of this rank's shards ended (stamped only if it succeeded)."""
    received: bool = False
    """The sender's copy arrived whole."""
    values: dict[str, Any] = field(default_factory=dict)
    """The optimizer's param-group settings (lr, ...) at ``step``, by flat key."""
    swapped: threading.Event = field(default_factory=threading.Event)
    """Set when this rank's copy, its sending and its receiving ended, whether or not they succeeded."""
    exchanged: Future[None] | None = None
    """Ends once every rank's buddy holds its copy (every rank learns it); raises if any
    rank's copy or exchange failed."""

    def complete(self) -> bool:
        done = self.exchanged
        return done is not None and done.done() and done.exception() is None


class Snapshots:
    """One rank's snapshots for one world. Every rank makes the same calls at the same steps."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        world_size: int,
        place: tuple[str, str],
        every: int | None,
        timeout: Any,
        ranks_on_node: int = 1,
        max_every: int = 1,
        start_at: int = 0,
    ) -> None:
        """Collective (every rank of the world, same order of groups): creates the exchange
        group, learns every rank's place (failure domain, node) and checks that host memory
        holds the snapshots and a re-form's peak on every node; if not, every rank raises
        ``SnapshotMemoryError``.
        ``every``: steps between snapshots, None: auto; ``max_every``: the most steps a node
        lost without notice may cost (``snapshot.max_every``); ``start_at``: the step the
        world restored its state at (0: it starts from nothing), snapshotted at once
        (``_start``)."""
        if max_every < 1 or (every is not None and not 1 <= every <= max_every):
            raise ValueError(f"snapshots every {every} steps cannot keep a loss within max_every={max_every}")
        if any(getattr(p, "device_mesh", None) is not None and p.device_mesh.ndim != 1 for p in model.parameters()):
            raise ConfigError(
                "snapshot.every: in-memory snapshots need the model sharded over one dimension (elastic.world().mesh); "
                "a 2-D mesh (HSDP) is not kept in memory: set snapshot.every: 0 (re-forms then load the checkpoint)"
            )
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = rank, world_size
        self.auto = every is None
        self.max_every = max_every
        self.interval: Interval = interval_for(None, max_every)
        """With ``auto``: the interval chosen at the last boundary, and why."""
        self.every = self.interval.every if every is None else every
        """Steps between snapshots now (``auto``: from ``max_every`` down, as the cost allows)."""
        self.host_bytes = SNAPSHOT_COPIES * share_bytes(model, world_size)
        """Host memory the snapshots take on this rank (own and received, both generations)."""
        self.group = side_group(timeout)
        refusal = memory_refusal(model, self.host_bytes, ranks_on_node)
        gathered: list[Any] = [None] * world_size
        has_state = bool(optimizer.state)
        dist.all_gather_object(gathered, (tuple(place), refusal, has_state), group=self.group)
        refused = next((f"rank {r}: {why}" for r, (_, why, _) in enumerate(gathered) if why), None)
        if refused:
            raise SnapshotMemoryError(refused)
        places = [tuple(p) for p, _, _ in gathered]
        self.buddy = buddies(places)
        self.sender = self.buddy.index(rank)
        self.device = next(model.parameters()).device
        self.pinned = self.device.type == "cuda"
        """On CUDA: pinned host buffers, copied into on a side stream (DMA)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regroup-snapshot")
        self._sources: dict[str, torch.Tensor] | None = None
        """Key -> the live tensor a snapshot copies: a shard, or a replicated value whole."""
        self._spans: dict[str, tuple[int, int]] = {}
        """Replicated key -> the flat elements of it this rank keeps (the rest: the other ranks)."""
        self._settings: dict[str, tuple[int, str]] = {}
        """Param-group setting's flat key -> (group index, name), read at every snapshot."""
        self._stream: torch.cuda.Stream | None = None
        self._allocating: Future[None] | None = None
        self.ready = False
        """Every rank has its buffers (agreed at a boundary): snapshots may be taken."""
        self._template: HeldState | None = None
        self._own: list[torch.Tensor] = []
        self._received: list[torch.Tensor] = []
        self.committed: Generation | None = None
        self.in_flight: Generation | None = None
        self.last_step: int | None = None
        """The step of the newest snapshot taken (None: none yet in this world)."""
        self._reported = False
        self.stall_s = 0.0
        """Time the loop waited for the snapshots, in total."""
        self.meter = CostMeter()
        self._active = False
        self._reported_interval = False
        if places[rank] == places[self.buddy[rank]] and world_size > 1:
            log.warning("snapshot buddy shares this node: a node loss falls back to storage", buddy=self.buddy[rank])
        if start_at > 0 and all(state for _, _, state in gathered):
            self._start(start_at)

    def _start(self, step: int) -> None:
        """The world's first snapshot, of the state it restored at ``step``, taken now on
        every rank (the constructor is collective): the buffers are allocated and the copy
        and exchange run in the background, beside the first step's forward and backward
        (``wait_copied`` holds its optimizer step until the copy is done). The next step
        counts only once every buddy holds it (``before_step_counts``), so a node lost in a
        world's first steps costs at most ``max_every`` steps as well: without it the state
        the world resumed from was held nowhere but in the ranks, and such a loss went back
        to the last committed checkpoint."""
        self._plan()
        self._allocating = self._executor.submit(self._allocate)
        self.ready = True
        self.take(step)
        self._active = True
        if self.rank == 0:
            log.info("snapshot of the restored state", step=step, world_size=self.world_size)

    # --- the loop's calls ---------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether to take one now: the world's first as soon as every rank has its buffers,
        then every ``every`` steps."""
        if not self.ready or self.in_flight is not None:
            return False
        return self.last_step is None or step - self.last_step >= self.every

    def take(self, step: int) -> None:
        """At the agreed boundary of ``step`` (the optimizer step done on every rank): copy
        this rank's shards and start exchanging them. The copy overlaps the next step's
        forward and backward; ``wait_copied`` must be called before its optimizer step."""
        slot = 0 if self.committed is None else 1 - self.committed.slot
        groups = self.optimizer.param_groups
        generation = Generation(step, slot, values={k: groups[i][name] for k, (i, name) in self._settings.items()})
        stream_event = None
        if self.pinned:
            stream_event = torch.cuda.Event()
            stream_event.record()
        self.in_flight = generation
        self.last_step = step
        generation.exchanged = self._executor.submit(self._run, generation, stream_event)

    def wait_copied(self) -> float:
        """Block until the in-flight snapshot's copy is done (the live state may change after);
        the seconds waited."""
        generation = self.in_flight
        if generation is None or generation.copied.is_set():
            return 0.0
        started = time.perf_counter()
        while not generation.copied.wait(0.05):
            assert generation.exchanged is not None
            if generation.exchanged.done():
                break  # failed before the copy finished: nothing more to wait for
        waited = time.perf_counter() - started
        self.stall_s += waited
        return waited

    def before_step_counts(self, step: int) -> float:
        """Before ``step`` counts as done on this rank (the loop's step count, the sample log
        and progress move to it): wait until every buddy holds a generation at most
        ``max_every`` steps older, so that a node lost from then on costs at most ``max_every``
        steps. The seconds waited. Raises when that generation's exchange failed (a peer went
        away): the step does not count, and the world re-forms from what is held."""
        oldest = step - self.max_every
        if not self.ready:
            return 0.0  # a world's first steps, before its first snapshot: nothing to wait for
        if self.committed is not None and self.committed.step >= oldest:
            return 0.0
        generation = self.in_flight
        if generation is None or generation.step < oldest:
            return 0.0  # none could do (``due`` takes them in time): the boundary's own rules apply
        exchanged = generation.exchanged
        assert exchanged is not None
        waited = 0.0
        if not exchanged.done():
            started = time.perf_counter()
            wait([exchanged])  # a dead peer fails it; a frozen one is cut off by the world's watcher
            waited = time.perf_counter() - started
            self.stall_s += waited
        failure = exchanged.exception()
        if failure is not None:
            # The original message is kept: it says whether a peer went away (regroup.failures).
            raise RuntimeError(
                f"step {step} does not count: the snapshot of step {generation.step} did not reach every "
                f"buddy: {failure}"
            ) from failure
        return waited

    def done(self, step: int) -> bool:
        """This rank's contribution to the boundary of ``step``: its in-flight generation is
        complete. When the next snapshot is due now, waits for the exchange first (counted
        as stall), so a generation is never more than ``every`` steps old."""
        if not self.ready:
            # Host buffers are allocated in the background (pinned memory takes seconds per
            # GB): snapshots start once every rank has them, without stalling the loop.
            if self._allocating is None:
                self._plan()
                self._allocating = self._executor.submit(self._allocate)
            if self._allocating.done():
                self._allocating.result()  # raises what the allocation raised
                return True
            return False
        generation = self.in_flight
        if generation is None:
            return True
        exchanged = generation.exchanged
        assert exchanged is not None
        if not exchanged.done() and step - generation.step >= self.every:
            started = time.perf_counter()
            wait([exchanged])  # a dead peer fails it; a frozen one is cut off by the world's watcher
            self.stall_s += time.perf_counter() - started
        if exchanged.done() and exchanged.exception() is not None and not self._reported:
            self._reported = True  # the world is breaking; a re-form will follow
            log.warning("snapshot exchange failed", step=generation.step, error=str(exchanged.exception())[:200])
        return generation.complete()

    def observe(self, step_s: float) -> float:
        """Record the step that just ran (``step_s``: from its start to its boundary, the
        waits for snapshots included); what a snapshot costs, as ``CostMeter.cost``."""
        self.meter.record(step_s, self._active)
        return self.meter.cost()

    def agreed(self, all_done: bool, mean_cost: float) -> None:
        """After a boundary: once every rank completed the in-flight generation it becomes
        the one to recover from, and (``auto``) the interval follows the agreed cost: as
        few steps apart as keeps it under ``STALL_BUDGET`` of the step time, and never more
        than ``max_every``."""
        if not self.ready:
            self.ready = all_done
            if self.ready and self.auto:
                self._choose_interval(mean_cost)
            return
        if self.in_flight is not None and all_done:
            self.committed, self.in_flight = self.in_flight, None
            self.meter.snapshot_done()
        if self.auto:
            self._choose_interval(mean_cost)

    def _choose_interval(self, mean_cost: float) -> None:
        # Every rank saw the same steps with and without snapshots: all agree on ``measured``.
        chosen = interval_for(mean_cost if self.meter.measured() else None, self.max_every)
        changed = (chosen.every, chosen.capped) != (self.interval.every, self.interval.capped)
        if self.rank == 0 and (changed or not self._reported_interval):
            log.info(
                "snapshot interval",
                every=chosen.every,
                max_every=chosen.max_every,
                capped=chosen.capped,
                wanted=chosen.wanted,
                cost_share=None if chosen.cost_share is None else round(chosen.cost_share, 4),
                reason=chosen.reason,
            )
        self._reported_interval = True
        self.interval, self.every = chosen, chosen.every

    def settled(self) -> None:
        """After the boundary's decisions (``agreed``, then ``take`` if ``due``): whether the
        next step runs beside snapshot work."""
        self._active = self.in_flight is not None

    def complete_at(self, step: int) -> None:
        """Collective, at the agreed boundary of ``step`` (not stepped further): the generation
        of ``step``, taken now if it was not, complete on every rank and the one to recover
        from. Raises when an exchange failed (a peer went away)."""
        for _ in range(2):
            generation = self.in_flight
            if generation is not None:
                assert generation.exchanged is not None
                wait([generation.exchanged])
                generation.exchanged.result()
                self.committed, self.in_flight = generation, None
                self.meter.snapshot_done()
            if self.committed is not None and self.committed.step == step:
                break
            self.take(step)
        self._active = False

    def held(self, wait_s: float = 2.0) -> list[HeldState]:
        """For a re-form after a failure: every generation this rank holds whole, its own and
        its sender's, as states ``redistribute`` can choose from."""
        if self._template is None:
            return []
        held = []
        for generation in (self.committed, self.in_flight):
            if generation is None:
                continue
            if generation.exchanged is not None:
                # A peer gone (or the wire cut) fails the exchange: the copies may still be whole.
                generation.swapped.wait(wait_s)
            if generation.copied.is_set():
                held.append(self._state(self._own[generation.slot], self.rank, generation))
            if generation.received:
                held.append(self._state(self._received[generation.slot], self.sender, generation))
        return [h for h in held if h is not None]

    def close(self) -> None:
        """The world is ending: let an exchange in progress finish or fail, then stop the thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def copy_bytes(self) -> tuple[int, int]:
        """(this rank's copy, the copy it keeps for its sender), in bytes of one generation;
        (0, 0) until the first snapshot laid them out."""
        if self._template is None:
            return 0, 0
        return self._own_layout.nbytes, self._sender_layout.nbytes

    # --- inside --------------------------------------------------------------------------

    def _plan(self) -> None:
        """Find the live tensors (after the first optimizer step, when AdamW's state exists)
        and lay out the buffers."""
        flat = split_state(flat_state(self.model, self.optimizer))
        sources: dict[str, torch.Tensor] = {}
        shapes = []
        for key, value in sorted(flat.tensors.items()):
            if key in flat.sharded:
                sources[key] = value.to_local()
                shapes.append((key, tuple(sources[key].shape), value.dtype))
            else:
                sources[key] = value.detach()
                self._spans[key] = flat_span(value.numel(), self.world_size, self.rank)
                shapes.append((key, (self._spans[key][1] - self._spans[key][0],), value.dtype))
        template = HeldState(self.rank, self.world_size, -1, sources, flat.sharded, flat.shapes, flat.values, CHUNK)
        own = layout_for(template, self.rank, self.world_size)
        if own != Layout.of(shapes):
            raise ValueError("snapshot: this rank's shards are not the torch.chunk rows of its parameters")
        self._own_layout, self._sender_layout = own, layout_for(template, self.sender, self.world_size)
        self._sources, self._template = sources, template
        self._settings = setting_keys(self.model, self.optimizer, flat.values)

    def _allocate(self) -> None:
        self._own = [self._buffer(self._own_layout.nbytes) for _ in range(GENERATIONS)]
        self._received = [self._buffer(self._sender_layout.nbytes) for _ in range(GENERATIONS)]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        # Written once here, in the background: the first snapshots into it then pay no
        # page faults (about 0.5 ms per MB) beside the step they overlap.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).zero_()

    def _run(self, generation: Generation, after: torch.cuda.Event | None) -> None:
        try:
            self._copy(generation, after)
            failure = None if self.world_size == 1 else self._swap(generation)
        finally:
            generation.swapped.set()
        if failure is not None:
            raise failure  # the others learn it as the world breaks (their acknowledgement fails)
        if self.world_size > 1:
            # Every rank learns that every buddy holds its copy (nobody gets past this until
            # all have): only then may a step after this generation count (``before_step_counts``).
            dist.all_reduce(torch.ones(1, dtype=torch.int32), group=self.group)

    def _copy(self, generation: Generation, after: torch.cuda.Event | None) -> None:
        """This rank's shards into its buffer of ``generation``, stamped once whole."""
        assert self._sources is not None
        own = self._own[generation.slot]
        try:
            views = self._own_layout.views(own)
            keys = list(self._sources)
            sources = [self._live(key) for key in keys]  # one call copies all
            with torch.no_grad():
                if after is not None:
                    with torch.cuda.device(self.device):
                        if self._stream is None:
                            self._stream = torch.cuda.Stream()
                        self._stream.wait_event(after)  # the optimizer step that made this state
                        with torch.cuda.stream(self._stream):
                            torch._foreach_copy_([views[k] for k in keys], sources, non_blocking=True)
                        self._stream.synchronize()
                else:
                    torch._foreach_copy_([views[k] for k in keys], sources)
            self._own_layout.stamp(own).copy_(torch.tensor([generation.step, self.rank], dtype=STAMP))
        finally:
            generation.copied.set()

    def _swap(self, generation: Generation) -> Exception | None:
        """Send this rank's copy to its buddy and receive its sender's; what failed, if anything."""
        own = self._own[generation.slot]
        received = self._received[generation.slot]
        self._sender_layout.stamp(received).zero_()  # a stale stamp must not pass for this generation's
        sending = dist.isend(own, self.buddy[self.rank], group=self.group)
        receiving = dist.irecv(received, self.sender, group=self.group)
        failure: Exception | None = None
        try:
            # Wait for the copy we keep even when ours could not be sent: if our buddy is the
            # node that died, the sender's copy is still whole and needed.
            receiving.wait()
            stamp = self._sender_layout.stamp(received).tolist()
            if stamp != [generation.step, self.sender]:
                raise RuntimeError(f"snapshot from rank {self.sender}: stamp {stamp}, expected {generation.step}")
            generation.received = True
        except Exception as exc:
            failure = exc
        try:
            sending.wait()
        except Exception as exc:
            failure = failure or exc
        return failure

    def _live(self, key: str) -> torch.Tensor:
        """What this rank copies of ``key``: its shard, or its flat chunk of a replicated value."""
        assert self._sources is not None
        tensor = self._sources[key]
        if key not in self._spans:
            return tensor
        lo, hi = self._spans[key]
        return tensor.reshape(-1)[lo:hi]

    def _state(self, buffer: torch.Tensor, rank: int, generation: Generation) -> HeldState | None:
        assert self._template is not None
        layout = self._own_layout if rank == self.rank else self._sender_layout
        if layout.stamp(buffer).tolist() != [generation.step, rank]:
            return None
        t = self._template
        # Host tensors: ``redistribute`` copies them into the new model's and optimizer's own.
        values = {**t.values, **generation.values}
        return HeldState(rank, self.world_size, generation.step, layout.views(buffer), t.sharded, t.shapes, values, CHUNK)

