"""Plain data (YAML/JSON) to the settings tree, converted by the dataclasses' type hints.

Each value is checked against its field's type (durations, literals, unions, nested
sections, tuples) and an error names the field it is in (``faults[0].rank``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

from regroup.trainer.config import ConfigError


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
