"""The settings a run takes from the public API and the built-in trainer alike: batches,
checkpoints, the job's etcd, in-place re-forms, snapshots and injected faults. Frozen
dataclasses, validated at construction: a bad value raises ``ConfigError`` naming the field
(``batch.global_batch_size: must be >= 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""



@dataclass(frozen=True)
class BatchConfig:
    """The global batch is constant; per-rank micro-batches and accumulation adapt to the world."""

    global_batch_size: int = 12
    """Samples per optimizer step across all ranks; must divide by the world size."""
    max_micro_batch_size: int = 0
    """Largest micro-batch one rank runs at once; 0 means the rank's whole share in one go."""

    def __post_init__(self) -> None:
        positive("batch.global_batch_size", self.global_batch_size)
        if self.max_micro_batch_size < 0:
            raise ConfigError("batch.max_micro_batch_size: must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """Sharded DCP checkpoints under ``<dir>/step-N/``, valid only with their commit marker."""

    dir: str | None = None
    """Checkpoint folder; unset disables checkpoints. A run always resumes from the newest
    committed checkpoint in it, at whatever world size it has: a fresh run needs a fresh folder."""
    every_steps: int = 0
    """Save every K steps; 0 disables the step trigger."""
    every: timedelta = timedelta(0)
    """Save when this much time passed since the last save; 0 disables the time trigger."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones are deleted once a newer one commits."""
    async_save: bool = True
    """Stage to memory and write in a background thread (training stalls only for staging)."""
    at_end: bool = True
    """Save when max_steps is reached."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("checkpoint.every_steps: must be >= 0")
        positive("checkpoint.keep_last", self.keep_last)


@dataclass(frozen=True)
class EtcdConfig:
    """The job's etcd keys: checkpoint requests in, acks and progress out."""

    endpoint: str = ""
    """``host:port[,host:port]``; default: env REGROUP_ETCD_ENDPOINT."""
    job: str = ""
    """Job name (the ``regroup.dev/job`` label); default: env TORCHELASTIC_RUN_ID."""
    namespace: str = "default"
    """Kubernetes namespace of the job; default: env POD_NAMESPACE, else ``default``."""
    progress_interval: timedelta = timedelta(seconds=5)
    """How often rank 0 publishes ``progress`` (also at start and on exit)."""
    request_timeout: timedelta = timedelta(seconds=5)
    """Deadline of one etcd request."""
    cacert: str | None = None
    """CA bundle for a TLS etcd."""
    cert: str | None = None
    """Client certificate (mutual TLS)."""
    key: str | None = None
    """Client key (mutual TLS)."""

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ConfigError("etcd.endpoint: required (or set REGROUP_ETCD_ENDPOINT)")
        if not self.job or "/" in self.job:
            raise ConfigError("etcd.job: required and without '/' (or run under torchrun with --rdzv-id)")
        if self.progress_interval <= timedelta(0):
            raise ConfigError("etcd.progress_interval: must be > 0")


@dataclass(frozen=True)
class ReformConfig:
    """In-place re-forms (under ``regroup-run``): how a surviving process changes world."""

    in_memory: bool = True
    """Rebuild the sharding from the survivors' memory when they hold every old rank's
    shards at one agreed step (grows; planned shrinks, whose leaving ranks hand theirs over);
    False: always load the newest committed checkpoint."""
    abort_grace: timedelta = timedelta(seconds=1)
    """After a re-form is announced, how long a rank may stay inside a collective (a peer is
    dead or hung) before its process group's connections are cut so the call fails."""
    wait: timedelta = timedelta(minutes=5)
    """How long a survivor waits for its next world; past it, it exits and its agent
    restarts it (the restart path)."""
    ack_from_memory: bool = True
    """With ``in_memory``: answer a planned re-form's checkpoint request from memory (ack at
    the agreed boundary, the live state handed over in place) and write the storage
    checkpoint in the background once the next world has resumed: no disk write on the
    re-form's critical path. A hand-off that fails then (a second node lost meanwhile)
    falls back to the snapshots or the last committed checkpoint. False: save and commit
    before the ack."""

    def __post_init__(self) -> None:
        if self.wait <= timedelta(0):
            raise ConfigError("reform.wait: must be > 0")


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots (under ``regroup-run``): every ``every`` steps each rank keeps its
    model and optimizer shards in host memory, and a copy on a rank of another node, so a
    node lost without notice costs at most ``max_every`` steps instead of everything since
    the last committed checkpoint. Host memory: about 4x the rank's share of model + optimizer
    state (two generations of its own snapshot and of the copy it keeps for its sender)."""

    every: int | Literal["auto"] = "auto"
    """Steps between snapshots; ``auto``: every step while a snapshot costs under 2% of the
    step time (measured: steps beside a snapshot against steps without), less often when it
    would cost more, never more than ``max_every`` steps apart; 0: no snapshots."""
    max_every: int = 1
    """The most steps a node lost without notice may cost (a world that restored its
    state snapshots it at once; a job's first world from its first snapshot on): no step counts as done until a snapshot at most this many steps older is held by
    every rank's buddy. ``every: auto`` never spaces snapshots wider; an explicit ``every``
    larger than this is an error. Raising it lets ``auto`` take snapshots less often where
    they cost more than 2% of a step, for up to this many lost steps."""

    def __post_init__(self) -> None:
        if self.every != "auto" and self.every < 0:
            raise ConfigError("snapshot.every: must be >= 0 or auto")
        if self.max_every < 1:
            raise ConfigError("snapshot.max_every: must be >= 1")
        if self.every != "auto" and self.every > self.max_every:
            # The bound is the promise: a wider explicit interval would break it without a word.
            raise ConfigError(
                f"snapshot.every: {self.every} is more than snapshot.max_every={self.max_every} (the most steps "
                f"a node lost without notice may cost); set snapshot.max_every: {self.every} to accept losing "
                f"up to {self.every} steps, or lower snapshot.every"
            )

    @property
    def interval(self) -> int | None:
        """Steps between snapshots (None: auto, 0: off)."""
        return None if self.every == "auto" else int(self.every)


@dataclass(frozen=True)
class Fault:
    """An injected failure at a (rank, step), for tests of the recovery paths."""

    kind: Literal["crash", "hang", "kill_during_save", "refuse_reform"]
    """``crash``: the rank fails before training step ``step``; ``hang``: it stops making
    progress there (a stuck host), leaving its peers blocked in a collective;
    ``kill_during_save``: it is SIGKILLed after writing its shard of the checkpoint of step
    ``step``, before that checkpoint is committed; ``refuse_reform``: its first in-place
    re-form at or after step ``step`` fails, so its agent restarts it (the fallback path)."""
    rank: int
    """Global rank that fails."""
    step: int
    """Training step at which it fails."""
    restart: int = 0
    """Only in this incarnation (env TORCHELASTIC_RESTART_COUNT), so the restarted job recovers."""


def positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be >= 1" if isinstance(value, int) else f"{name}: must be > 0")
