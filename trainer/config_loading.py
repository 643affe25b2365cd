"""Where the trainer's settings come from: a YAML/JSON file, ``--set a.b=value`` overrides
and the environment, read once here and validated into a ``TrainConfig``.

Nothing below this module reads the environment.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from regroup.trainer.config import ConfigError, TrainConfig
from regroup.trainer.config_parsing import build


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` (value read as a YAML scalar) to a nested dict in place."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected key.sub=value")
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {part} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def config_from_dict(
    data: Mapping[str, Any] | None, env: Mapping[str, str] | None = None, overrides: Sequence[str] = ()
) -> TrainConfig:
    """Build and validate a TrainConfig from plain data, the environment and overrides."""
    env = env or {}
    tree: dict[str, Any] = copy.deepcopy(dict(data or {}))
    for assignment in overrides:
        apply_override(tree, assignment)
    etcd_section = tree.get("etcd")
    if etcd_section is not None or env.get("REGROUP_ETCD_ENDPOINT"):
        section = dict(etcd_section or {})
        section.setdefault("endpoint", env.get("REGROUP_ETCD_ENDPOINT", ""))
        section.setdefault("job", env.get("TORCHELASTIC_RUN_ID", ""))
        section.setdefault("namespace", env.get("POD_NAMESPACE") or "default")
        tree["etcd"] = section
    # Where a launcher (``regroup demo``, a pod spec) puts this run's files, unless the config says.
    if env.get("REGROUP_CHECKPOINT_DIR") and not (tree.get("checkpoint") or {}).get("dir"):
        tree["checkpoint"] = {**(tree.get("checkpoint") or {}), "dir": env["REGROUP_CHECKPOINT_DIR"]}
    if env.get("REGROUP_SAMPLE_LOG") and not (tree.get("data") or {}).get("sample_log"):
        tree["data"] = {**(tree.get("data") or {}), "sample_log": env["REGROUP_SAMPLE_LOG"]}
    if env.get("REGROUP_LOG_EVERY") and "log_every" not in tree:
        apply_override(tree, f"log_every={env['REGROUP_LOG_EVERY']}")
    faults_env = env.get("REGROUP_TRAINER_FAULTS")
    if faults_env:
        try:
            tree["faults"] = list(tree.get("faults") or []) + list(json.loads(faults_env))
        except ValueError as exc:
            raise ConfigError(f"REGROUP_TRAINER_FAULTS: not a JSON list: {exc}") from exc
    return build(TrainConfig, tree, "")


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> TrainConfig:
    """Read a YAML or JSON config file (or none: all defaults) and validate it."""
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not YAML/JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return config_from_dict(data, env, overrides)
