"""A job's trainer rank 0 as etcd sees it, without the training.

The trainer's own etcd side does the work: ``JobChannel`` (it imports no torch) watches
``control/checkpoint`` and ``control/reform``, writes ``progress`` and the acks, and
``pending_generation`` decides which request a step boundary answers. What is left out is
the model: a step is ``step_time`` of waiting, the loss a constant. The records and their
rhythm are the trainer's (``regroup.elastic.world.progress``): progress every
``progress_interval``, at once after the first step of a new world, and a last one when
the run ends; an ack, from memory as an in-place re-form gives it, at the first step
boundary after a request, and with ``hold`` no step after it until the re-form (or the
request's deadline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from bench.platform.agent_specs import JobTls
from regroup.elastic.checkpoint.folders import checkpoint_id
from regroup.elastic.settings import EtcdConfig
from regroup.elastic.world.control import JobChannel, pending_generation
from regroup.records import CheckpointAck, Progress

GLOBAL_BATCH = 64
"""Samples per step, for ``samples_seen``: the record's size is what matters to etcd."""


class RankZero:
    """Steps, answers checkpoint requests and publishes progress while its job has a world."""

    def __init__(
        self, endpoint: str, namespace: str, job: str, step_time: timedelta, progress_interval: timedelta,
        on_resumed: Callable[[int], None], tls: JobTls | None = None,
    ) -> None:
        """``on_resumed(round)``: the first step of a new world was published. ``tls``: the
        job's certificate, which the trainer's channel presents as the agents do."""
        files = {"cacert": tls.cacert, "cert": tls.cert, "key": tls.key} if tls is not None else {}
        self.channel = JobChannel(
            EtcdConfig(endpoint=endpoint, job=job, namespace=namespace, progress_interval=progress_interval, **files)
        )
        self._step_s = step_time.total_seconds()
        self._interval_s = progress_interval.total_seconds()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._world: tuple[int, int] | None = None
        """(round, world size) of the world training now; None between worlds."""
        self._new_world = False
        self._held_until = 0.0
        """Unix time until which a ``hold`` request keeps the job at its acked step."""
        self._step = 0
        self._resumed_from = 0
        self._requests = 0
        self._on_resumed = on_resumed
        self._thread = threading.Thread(target=self._run, name=f"rank0-{job}", daemon=True)

    def start(self) -> None:
        self.channel.start()
        self._thread.start()

    def world_formed(self, round_: int, world_size: int) -> None:
        """Every rank of round ``round_`` has its place: the first step there publishes at once."""
        with self._lock:
            self._world = (round_, world_size)
            self._new_world = True
            self._held_until = 0.0
            self._resumed_from = self._step

    def world_ending(self) -> None:
        """The agents are re-forming: no step until the next world forms."""
        with self._lock:
            self._world = None

    def finish(self) -> None:
        """The run is over: the last progress record, then the channel closes."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            world = self._world
        if world is not None:
            self.channel.publish_progress(self._progress(world, "finished"), wait=True)
        self.channel.close()

    def _run(self) -> None:
        last_publish = 0.0
        while not self._stop.wait(self._step_s):
            with self._lock:
                world, first = self._world, self._new_world
                self._new_world = False
                if world is None or time.time() < self._held_until:
                    continue
                self._step += 1
            self._answer(world)
            now = time.monotonic()
            if first or now - last_publish >= self._interval_s:
                self.channel.publish_progress(self._progress(world, "training"), wait=first)
                last_publish = now
            if first:
                self._on_resumed(world[0])

    def _answer(self, world: tuple[int, int]) -> None:
        channel = self.channel
        request = channel.request()
        generation = pending_generation(request, time.time(), channel.answered, channel.reformed)
        if not generation or request is None:
            return
        self._requests += 1
        ack = CheckpointAck(
            generation=generation, step=self._step, checkpoint_id=checkpoint_id(self._step), duration_s=0.0,
            world_size=world[1], acked_at=time.time(), stored=False,
        )  # fmt: skip
        if channel.ack(ack, deadline=request.deadline) and request.hold:
            with self._lock:
                self._held_until = request.deadline
            self.channel.publish_progress(self._progress(world, "holding"))

    def _progress(self, world: tuple[int, int], state: str) -> Progress:
        round_, size = world
        return Progress(
            step=self._step, loss=2.5, samples_seen=self._step * GLOBAL_BATCH, world_size=size, time=time.time(),
            tokens_per_s=0.0, resumed_from_step=self._resumed_from, last_step=self._resumed_from, round=round_,
            reform_mode="in-place" if self._resumed_from else "",
            extra={"state": state, "samples_per_s": round(GLOBAL_BATCH / self._step_s, 3), "checkpoint_saves": 0,
                   "requests_honoured": self._requests, "last_checkpoint_stall_s": 0.0, "last_committed_step": None},
        )  # fmt: skip
