"""Rank 0's side of the job's etcd keys: checkpoint requests in; acks and progress out.

``pending_generation`` is the pure decision (which request to honour now); ``JobChannel``
is the thin adapter: a reflector of ``control/checkpoint`` kept in a background loop
thread (listed again when etcd restarts), and writes of ``progress`` and
``acks/<generation>/commit``. The training loop never blocks on etcd except to ack.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog

from regroup.etcd import (
    TRANSIENT_ERRORS,
    EtcdSettings,
    Listed,
    LoopThread,
    Put,
    Reflector,
    ReflectorEvent,
    connect,
)
from regroup.keys import JobKeys, KeyKind, decode
from regroup.records import CheckpointAck, CheckpointRequest, Progress, RecordError, ReformRequest
from regroup.elastic.settings import EtcdConfig

log = structlog.get_logger("regroup.trainer.control")

_RETRY = 0.5


def pending_generation(request: CheckpointRequest | None, now: float, answered: int, reformed: int = 0) -> int:
    """The generation to checkpoint for at this boundary, or 0 for none: a request is
    honoured once, and not after its deadline, and never once its plan has asked for the
    re-form (``reformed``: the newest ``control/reform`` generation): a plan that fell back
    to the unplanned path re-forms without its checkpoint, and nothing may hold on it then."""
    if request is None or request.generation <= max(answered, reformed) or now >= request.deadline:
        return 0
    return request.generation


def settings_for(cfg: EtcdConfig) -> EtcdSettings:
    return EtcdSettings.from_endpoint_string(
        cfg.endpoint,
        cacert=Path(cfg.cacert) if cfg.cacert else None,
        cert=Path(cfg.cert) if cfg.cert else None,
        key=Path(cfg.key) if cfg.key else None,
        request_timeout=cfg.request_timeout,
    )


class JobChannel:
    """Rank 0's connection to the job's keys. Thread-safe reads of the latest request."""

    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        self.keys = JobKeys(cfg.namespace, cfg.job)
        self._settings = settings_for(cfg)
        self._loop = LoopThread(name="regroup-trainer-etcd")
        self._lock = threading.Lock()
        self._request: CheckpointRequest | None = None
        self._client: Any = None
        self._watch_task: asyncio.Task[None] | None = None
        self._reform_task: asyncio.Task[None] | None = None
        self.answered = 0
        """Highest generation already acked (read at start, so a restart does not re-answer)."""
        self.latest_reform: ReformRequest | None = None
        """The newest ``control/reform`` (watched): its generation retires older requests."""
        self.previous_progress: Progress | None = None
        """The ``progress`` record as last read (``progress_before``)."""
        self._progress_sent = 0
        """Progress writes handed to the loop (a sequence number per call)."""
        self._progress_done = 0
        """The newest of them written (or given up): an older one arriving late is dropped."""

    @property
    def timeout(self) -> timedelta:
        return self.cfg.request_timeout

    def start(self) -> None:
        """Connect, read what was already answered and the current request, start the watch."""
        self._loop.run(self._start(), self.timeout * 3)

    async def _start(self) -> None:
        self._progress_lock = asyncio.Lock()
        self._client = await connect(self._settings)
        for kv in await self._client.get_prefix(self.keys.acks.encode()):
            found = decode(kv.key.decode(), None, self.keys.prefix)
            if found is not None and found.kind is KeyKind.ACK and found.params["generation"].isdigit():
                self.answered = max(self.answered, int(found.params["generation"]))
        reforms = Reflector(self._client, self.keys.reform, self._on_reform, prefix=False, name="reform-request")
        await reforms.list()
        requests = Reflector(self._client, self.keys.checkpoint, self._on_request, prefix=False, name="checkpoint-request")
        await requests.list()
        # Each ends only when cancelled; were one to crash, the loop thread logs and records it at once.
        self._reform_task = self._loop.supervise(asyncio.create_task(reforms.run(), name="reform-request-watch"))
        self._watch_task = self._loop.supervise(asyncio.create_task(requests.run(), name="checkpoint-request-watch"))

    async def _read_progress(self) -> None:
        progress = await self._client.get(self.keys.progress.encode())
        if progress is not None:
            try:
                self.previous_progress = Progress.from_json(progress.value)
            except RecordError as exc:
                log.warning("ignoring malformed progress record", error=str(exc))

    def progress_before(self) -> Progress | None:
        """The ``progress`` record the world before this one left, read as a new world starts,
        before it publishes any of its own (a process that kept rank 0 across worlds reads it
        again each time; the one read last when etcd does not answer in time)."""
        try:
            self._loop.run(self._read_progress(), self.timeout)
        except TRANSIENT_ERRORS as exc:
            log.warning("progress record not read; using the one read before", error=str(exc))
        return self.previous_progress

    def _on_reform(self, event: ReflectorEvent) -> None:
        if isinstance(event, Listed):
            put = event.items[0] if event.items else None
        else:
            put = event if isinstance(event, Put) else None
        if put is None or not put.value:
            return  # a deleted reform request retires nothing more than it did
        try:
            reform = ReformRequest.from_json(put.value)
        except RecordError as exc:
            log.warning("ignoring malformed reform request", error=str(exc))
            return
        with self._lock:
            if self.latest_reform is None or reform.generation >= self.latest_reform.generation:
                self.latest_reform = reform

    @property
    def reformed(self) -> int:
        """The newest re-form generation requested (0: none)."""
        with self._lock:
            return self.latest_reform.generation if self.latest_reform is not None else 0

    def _on_request(self, event: ReflectorEvent) -> None:
        if isinstance(event, Listed):
            put = event.items[0] if event.items else None  # the one key, or none
        else:
            put = event if isinstance(event, Put) else None
        request = None
        if put is not None and put.value:
            try:
                found = decode(put.key, put.value, self.keys.prefix)
            except RecordError as exc:
                log.warning("ignoring malformed checkpoint request", error=str(exc))
                return
            if found is not None and isinstance(found.record, CheckpointRequest):
                request = found.record
        with self._lock:
            self._request = request
        if request is not None:
            log.info("checkpoint request seen", generation=request.generation, hold=request.hold)

    def request(self) -> CheckpointRequest | None:
        with self._lock:
            return self._request

    def ack(self, ack: CheckpointAck, deadline: float) -> bool:
        """Write the ack, retrying through etcd blips until the request's ``deadline``
        (unix time): the controller is waiting on it. True once written."""
        key = self.keys.ack(ack.generation).encode()
        while True:
            try:
                self._loop.run(self._client.put(key, ack.to_json()), self.timeout)
                self.answered = max(self.answered, ack.generation)
                return True
            except TRANSIENT_ERRORS as exc:
                if time.time() + _RETRY >= deadline:
                    log.error("could not ack the checkpoint request", generation=ack.generation, error=str(exc))
                    self.answered = max(self.answered, ack.generation)
                    return False
                log.warning("ack write failed; retrying", generation=ack.generation, error=str(exc))
                time.sleep(_RETRY)

    def publish_progress(self, progress: Progress, wait: bool = False, timeout: timedelta | None = None) -> None:
        """Write ``progress``; without ``wait`` the loop does not block on etcd, with it the
        write gets at most ``timeout`` (default: the request timeout). Not written once the
        channel is closed (this rank no longer speaks for the job)."""
        if self._loop.closed:
            log.warning("progress not written: the job channel is closed", step=progress.step)
            return
        self._progress_sent += 1
        write = self._put_progress(progress, self._progress_sent)
        if not wait:
            self._loop.spawn(write)
            return
        future = self._loop.submit(write)
        try:
            future.result((timeout or self.timeout).total_seconds())
        except TimeoutError:
            log.warning("progress write timed out")

    async def _put_progress(self, progress: Progress, seq: int) -> None:
        # One write at a time, newest wins: an older record never lands after a newer one.
        async with self._progress_lock:
            if seq < self._progress_done:
                return
            self._progress_done = seq
            try:
                await self._client.put(self.keys.progress.encode(), progress.to_json())
            except TRANSIENT_ERRORS as exc:
                log.warning("progress write failed", error=str(exc))

    def close(self) -> None:
        """Stop the watch, close the client and the loop thread. Best effort (the trainer is
        leaving): an etcd error or timeout on the way is logged, not raised; a watch that had
        crashed was already recorded by the loop thread (``LoopThread.supervise``). Idempotent."""
        if self._loop.closed:
            return

        async def stop() -> None:
            tasks = [t for t in (self._watch_task, self._reform_task) if t is not None]
            for task in tasks:
                task.cancel()
            if tasks:
                # Waited for, not gathered: their outcome is the supervisor's to report.
                await asyncio.wait(tasks)
            if self._client is not None:
                await self._client.close()

        try:
            self._loop.run(stop(), self.timeout)
        except TRANSIENT_ERRORS as exc:
            log.warning("closing the job channel", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._loop.close()
