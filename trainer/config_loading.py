"""Where the trainer's settings come from: a YAML/JSON file, ``--set a.b=value`` overrides
and the environment, read once here and validated into a ``TrainConfig``.

Nothing below this module reads the environment.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from regroup.elastic.settings import ConfigError
from regroup.elastic.settings_parsing import apply_override, build, complete_from_env
from regroup.trainer.config import TrainConfig


def config_from_dict(
    data: Mapping[str, Any] | None, env: Mapping[str, str] | None = None, overrides: Sequence[str] = ()
) -> TrainConfig:
    """Build and validate a TrainConfig from plain data, the environment and overrides."""
    env = env or {}
    tree: dict[str, Any] = copy.deepcopy(dict(data or {}))
    for assignment in overrides:
        apply_override(tree, assignment)
    complete_from_env(tree, env)
    if env.get("REGROUP_SAMPLE_LOG") and not (tree.get("data") or {}).get("sample_log"):
        tree["data"] = {**(tree.get("data") or {}), "sample_log": env["REGROUP_SAMPLE_LOG"]}
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
