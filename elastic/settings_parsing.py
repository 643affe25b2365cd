"""Plain data (YAML/JSON), ``a.b=value`` overrides and the environment to a settings tree,
converted by the dataclasses' type hints.

Each value is checked against its field's type (durations, literals, unions, nested
sections, tuples) and an error names the field it is in (``faults[0].rank``). The
environment is read here and by the callers that hand it in, nowhere below.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import yaml

from regroup.elastic.settings import ConfigError


def parse_duration(value: Any, name: str) -> timedelta:
    """``30``, ``1.5``, ``"250ms"``, ``"30s"``, ``"2m"``, ``"1h"`` -> timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", value)
        if not match:
            raise ConfigError(f"{name}: expected a duration like 30s, 250ms, 2m; got {value!r}")
        scale = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}[match.group(2)]
        seconds = float(match.group(1)) * scale
    else:
        raise ConfigError(f"{name}: expected a duration, got {value!r}")
    if seconds < 0:
        raise ConfigError(f"{name}: must not be negative")
    return timedelta(seconds=seconds)


def _convert(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for inner in (a for a in args if a is not type(None)):
            try:
                return _convert(inner, value, name)
            except ConfigError as exc:
                errors.append(str(exc).removeprefix(f"{name}: "))
        raise ConfigError(f"{name}: {' or '.join(errors)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(c) for c in typing.get_args(tp))
            raise ConfigError(f"{name}: must be one of {choices}; got {value!r}")
        return value
    if origin is tuple:
        (inner, _) = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{name}: expected a list")
        return tuple(_convert(inner, v, f"{name}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return build(tp, value, name)
    if tp is timedelta:
        return parse_duration(value, name)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{name}: unsupported type {tp!r}")


def build(cls: type, data: Any, prefix: str) -> Any:
    """An instance of the dataclass ``cls`` from a mapping; ``prefix``: where it sits in the tree."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown field (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(hints[k], v, f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{prefix or 'config'}: {exc}") from exc


_ETCD_TLS_ENV = {"cacert": "REGROUP_ETCD_CACERT", "cert": "REGROUP_ETCD_CERT", "key": "REGROUP_ETCD_KEY"}
"""The etcd section's TLS fields and the variables ``regroup-run`` hands them to workers in."""


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


def complete_from_env(tree: dict[str, Any], env: Mapping[str, str]) -> None:
    """Fill in place what a launcher (``regroup-run``, ``regroup demo``, a pod spec) says
    through the environment, where the tree does not: the job's etcd
    (``REGROUP_ETCD_ENDPOINT``, ``TORCHELASTIC_RUN_ID``, ``POD_NAMESPACE``; a TLS etcd's
    ``REGROUP_ETCD_CACERT``, ``REGROUP_ETCD_CERT``, ``REGROUP_ETCD_KEY``), the checkpoint
    folder (``REGROUP_CHECKPOINT_DIR``), ``REGROUP_LOG_EVERY`` and injected faults
    (``REGROUP_TRAINER_FAULTS``, a JSON list, added to the tree's)."""
    etcd_section = tree.get("etcd")
    if etcd_section is not None or env.get("REGROUP_ETCD_ENDPOINT"):
        section = dict(etcd_section or {})
        section.setdefault("endpoint", env.get("REGROUP_ETCD_ENDPOINT", ""))
        section.setdefault("job", env.get("TORCHELASTIC_RUN_ID", ""))
        section.setdefault("namespace", env.get("POD_NAMESPACE") or "default")
        for field, variable in _ETCD_TLS_ENV.items():
            if env.get(variable):
                section.setdefault(field, env[variable])
        tree["etcd"] = section
    if env.get("REGROUP_CHECKPOINT_DIR") and not (tree.get("checkpoint") or {}).get("dir"):
        tree["checkpoint"] = {**(tree.get("checkpoint") or {}), "dir": env["REGROUP_CHECKPOINT_DIR"]}
    if env.get("REGROUP_LOG_EVERY") and "log_every" not in tree:
        apply_override(tree, f"log_every={env['REGROUP_LOG_EVERY']}")
    faults_env = env.get("REGROUP_TRAINER_FAULTS")
    if faults_env:
        try:
            tree["faults"] = list(tree.get("faults") or []) + list(json.loads(faults_env))
        except ValueError as exc:
            raise ConfigError(f"REGROUP_TRAINER_FAULTS: not a JSON list: {exc}") from exc
