"""The trainer's settings: one frozen dataclass tree, validated at construction.

Every field says what it means; a bad value raises ``ConfigError`` with a message that
names the field (``batch.global_batch_size: must be >= 1``). Building the tree from a
file, ``--set`` overrides and the environment is ``regroup.trainer.config_loading``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from regroup.elastic.settings import (
    BatchConfig,
    CheckpointConfig,
    ConfigError,
    EtcdConfig,
    Fault,
    ReformConfig,
    SnapshotConfig,
    positive,
)

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EtcdConfig",
    "Fault",
    "ModelConfig",
    "OptimConfig",
    "ReformConfig",
    "SnapshotConfig",
    "TrainConfig",
]




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
            positive(f"model.{name}", getattr(self, name))
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
        positive("optim.lr", self.lr)
        for name in ("min_lr_ratio", "weight_decay", "grad_clip", "warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"optim.{name}: must be >= 0")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ConfigError("optim.beta1/optim.beta2: must be in [0, 1)")


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
        positive("max_steps", self.max_steps)
        positive("log_every", self.log_every)
