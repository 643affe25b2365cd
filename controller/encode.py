"""Fast JSON for the controller's own records: the same bytes as ``Record.to_json``.

``Record.to_json`` goes through ``dataclasses.asdict``, which deep-copies every field;
the records are flat (strings, numbers, lists of strings), so a shallow dict encodes to
identical JSON at a fraction of the cost. The controller writes several per decision.
"""

from __future__ import annotations

import dataclasses
import json

from regroup.records import SCHEMA_VERSION, Record

_FIELDS: dict[type, tuple[str, ...]] = {}


def record_json(record: Record) -> bytes:
    """``record.to_json()``, without the deep copy."""
    names = _FIELDS.get(type(record))
    if names is None:
        names = _FIELDS[type(record)] = tuple(f.name for f in dataclasses.fields(record))
    body = {"v": SCHEMA_VERSION, "kind": record.kind}
    for name in names:
        body[name] = getattr(record, name)
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
