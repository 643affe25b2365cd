"""The trainer's settings: one frozen dataclass tree, validated at construction.

Every field says what it means; a bad value raises ``ConfigError`` with a message that
names the field (``batch.global_batch_size: must be >= 1``). Building the tree from a
file, ``--set`` overrides and the environment is ``regroup.trainer.config_loading``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""



@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, causal SDPA attention."""

    vocab_size: int = 256
    """Token ids are in [0, vocab_size)."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks (each is one FSDP unit)."""
    n_heads: int = 4
    """Attention heads; dim must divide by it."""
    ffn_hidden: int = 0
    """SwiGLU hidden width; 0 picks 8/3 * dim rounded up to a multiple of 64."""
    seq_len: int = 64
    """Tokens per sample (the model predicts seq_len next tokens)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (saves memory, costs ~1/3 compute)."""
    compile: bool = False
    """torch.compile each block (only applied on CUDA)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len"):
            _positive(f"model.{name}", getattr(self, name))
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim: {self.dim} must divide by model.n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError("model.dim: the head size dim/n_heads must be even for RoPE")
        if self.ffn_hidden < 0:
            raise ConfigError("model.ffn_hidden: must be >= 0")

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-int(8 * self.dim / 3) // 64) * 64


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Sample ``i`` is a function of ``i`` (and the seed) only."""

    source: Literal["synthetic", "file"] = "synthetic"
    """``synthetic``: a deterministic, learnable token stream; ``file``: a memory-mapped token file."""
    path: str | None = None
    """Token file (flat array of token ids), for source=file."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of the token file."""
    seed: int = 0
    """Seeds the synthetic stream and the per-epoch shuffle of the file's windows."""
    shuffle: bool = True
    """For source=file: visit the file's windows in a seeded per-epoch permutation."""
    sample_log: str | None = None
    """Folder where each rank appends one JSON line per step: the step, the global sample ids
    it trained on, its restart count, the world's rendezvous round and the time (auditing, tests)."""

    def __post_init__(self) -> None:
        if self.source == "file" and not self.path:
            raise ConfigError("data.path: required when data.source is 'file'")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay; the schedule is a function of the step."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warm-up length in steps."""
    decay_steps: int = 0
    """Cosine decay length after warm-up; 0 decays over max_steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        for name in ("min_lr_ratio", "weight_decay", "grad_clip", "warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"optim.{name}: must be >= 0")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ConfigError("optim.beta1/optim.beta2: must be in [0, 1)")


@dataclass(frozen=True)
class BatchConfig:
    """The global batch is constant; per-rank micro-batches and accumulation adapt to the world."""

    global_batch_size: int = 12
    """Samples per optimizer step across all ranks; must divide by the world size."""
    max_micro_batch_size: int = 0
    """Largest micro-batch one rank runs at once; 0 means the rank's whole share in one go."""

    def __post_init__(self) -> None:
        _positive("batch.global_batch_size", self.global_batch_size)
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
        _positive("checkpoint.keep_last", self.keep_last)


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
    """The most steps a node lost without notice may cost (from a world's first snapshot
    on): no step counts as done until a snapshot at most this many steps older is held by
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


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    etcd: EtcdConfig | None = None
    """Set to talk to the job's etcd keys (also enabled by env REGROUP_ETCD_ENDPOINT)."""
    reform: ReformConfig = field(default_factory=ReformConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    max_steps: int = 100
    """Stop after this many optimizer steps (counted across restarts)."""
    seed: int = 0
    """Seeds parameter initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA (NCCL, bf16 params) when present, else CPU (gloo, fp32)."""
    step_time_floor: timedelta = timedelta(0)
    """Pad each step to at least this long, so tiny CPU runs move at a watchable pace."""
    log_every: int = 10
    """Rank 0 logs a ``step`` event every N steps (default: env REGROUP_LOG_EVERY, else 10):
    a line a step floods a fast job's logs, and progress goes to etcd whatever this says."""
    faults: tuple[Fault, ...] = ()
    """Injected failures (also from env REGROUP_TRAINER_FAULTS as JSON)."""

    def __post_init__(self) -> None:
        _positive("max_steps", self.max_steps)
        _positive("log_every", self.log_every)


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be >= 1" if isinstance(value, int) else f"{name}: must be > 0")
