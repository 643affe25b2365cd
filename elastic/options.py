"""A run's settings: the keyword arguments of ``Run``, or the built-in trainer's config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Literal

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
from regroup.elastic.settings_parsing import build, complete_from_env


@dataclass(frozen=True)
class Options:
    """Everything a ``Run`` needs besides the user's ``build``. Made by ``Run``'s keyword
    arguments and the environment (``options``), or by a trainer from its own config."""

    global_batch: int
    """Samples per optimizer step, at every world size (the per-rank share adapts)."""
    max_steps: int
    """The run ends after this many optimizer steps, counted across re-forms and restarts."""
    max_micro_batch: int = 0
    """Largest micro-batch per forward/backward; 0: the rank's whole share at once."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    etcd: EtcdConfig | None = None
    reform: ReformConfig = field(default_factory=ReformConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    sample_log: str | None = None
    """Folder for per-rank sample logs (one JSON line per step), for audits and tests."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    step_time_floor: timedelta = timedelta(0)
    """Pad each step to at least this long (slow demos down)."""
    log_every: int = 10
    """Rank 0 logs a ``step`` event every N steps."""
    seed: int | None = None
    """The run's seed: the RNG of each step (``rng``) and keyed randomness derive from it;
    None: torch's initial seed when the run is created (the highest among the ranks)."""
    rng: Literal["step", "off"] = "step"
    """``step``: every rank's RNG (torch, Python, NumPy) is set at each step from (seed,
    step, rank), so a restored step draws what it drew before; ``off``: left alone."""
    faults: tuple[Fault, ...] = ()
    """Injected failures, for tests of the recovery paths (env REGROUP_TRAINER_FAULTS)."""

    @classmethod
    def of(cls, sections: Any, *, sample_log: str | None = None, seed: int | None = None) -> Options:
        """The settings from a tree with ``Sections``' fields: ``Sections`` itself, or a
        trainer's config that holds the same sections beside its own."""
        return cls(
            global_batch=sections.batch.global_batch_size,
            max_steps=sections.max_steps,
            max_micro_batch=sections.batch.max_micro_batch_size,
            checkpoint=sections.checkpoint,
            etcd=sections.etcd,
            reform=sections.reform,
            snapshot=sections.snapshot,
            sample_log=sample_log,
            device=sections.device,
            step_time_floor=sections.step_time_floor,
            log_every=sections.log_every,
            seed=seed,
            faults=sections.faults,
        )


@dataclass(frozen=True)
class Sections:
    """The settings tree ``Run`` takes (the built-in trainer's config has the same sections,
    beside its model, data and optimizer), validated field by field."""

    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    etcd: EtcdConfig | None = None
    reform: ReformConfig = field(default_factory=ReformConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    max_steps: int = 100
    device: Literal["auto", "cpu", "cuda"] = "auto"
    step_time_floor: timedelta = timedelta(0)
    log_every: int = 10
    sample_log: str | None = None
    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        positive("max_steps", self.max_steps)
        positive("log_every", self.log_every)


def _from_tree(tree: dict[str, Any], env: Mapping[str, str]) -> Options:
    complete_from_env(tree, env)
    if env.get("REGROUP_SAMPLE_LOG") and not tree.get("sample_log"):
        tree["sample_log"] = env["REGROUP_SAMPLE_LOG"]
    sections = build(Sections, tree, "")
    return Options.of(sections, sample_log=sections.sample_log)


def options_from_env(env: Mapping[str, str]) -> Options:
    """The defaults, completed from the environment (the job's etcd, the checkpoint folder)."""
    return _from_tree({}, env)


def options(
    env: Mapping[str, str],
    *,
    global_batch: int,
    max_steps: int,
    max_micro_batch: int = 0,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    snapshot_every: int | Literal["auto"] = "auto",
    snapshot_max_every: int = 1,
    device: Literal["auto", "cpu", "cuda"] = "auto",
    log_every: int | None = None,
    seed: int | None = None,
    rng: Literal["step", "off"] = "step",
    **sections: Any,
) -> Options:
    """``Run``'s keyword arguments, completed from the environment (the job's etcd from
    ``REGROUP_ETCD_ENDPOINT``, ``TORCHELASTIC_RUN_ID`` and ``POD_NAMESPACE``; the checkpoint
    folder from ``REGROUP_CHECKPOINT_DIR``; ``REGROUP_SAMPLE_LOG``; ``REGROUP_TRAINER_FAULTS``;
    ``log_every``, unless given, from ``REGROUP_LOG_EVERY``, else every 10 steps) and validated
    as the trainer's config is: a bad value raises ``ConfigError`` naming it.
    ``snapshot_every``/``snapshot_max_every``: ``snapshot.every`` and ``snapshot.max_every``
    (a node lost without notice costs at most ``snapshot_max_every`` steps).
    ``sections``: any other section of the settings tree (``Sections``) by name (``reform={...}``,
    ``etcd={...}``, ``checkpoint={...}``), for what the keywords do not cover; a ``snapshot``
    section's fields take precedence over the keywords."""
    snapshot: Any = {"every": snapshot_every, "max_every": snapshot_max_every}
    if isinstance(sections.get("snapshot"), Mapping):
        snapshot.update(sections["snapshot"])
    elif "snapshot" in sections:
        snapshot = sections["snapshot"]  # not a section: build says what is wrong with it
    tree: dict[str, Any] = {
        "batch": {"global_batch_size": global_batch, "max_micro_batch_size": max_micro_batch},
        "max_steps": max_steps,
        "device": device,
        **sections,
        "snapshot": snapshot,
    }
    if log_every is not None:
        tree["log_every"] = log_every
    checkpoint = dict(tree.get("checkpoint") or {})
    if checkpoint_dir is not None:
        checkpoint["dir"] = str(checkpoint_dir)
    if checkpoint_every:
        checkpoint["every_steps"] = checkpoint_every
    if checkpoint:
        tree["checkpoint"] = checkpoint
    if rng not in ("step", "off"):
        raise ConfigError(f"rng: must be 'step' or 'off', not {rng!r}")
    if seed is not None and (not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"seed: must be an integer >= 0, not {seed!r}")
    built = _from_tree(tree, env)
    return replace(built, seed=seed, rng=rng)
