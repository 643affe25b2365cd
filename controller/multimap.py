"""Indexes from one key to a set of values, with no empty sets left behind."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Hashable)


def index_add(index: dict[K, set[V]], key: K, value: V) -> None:
    index.setdefault(key, set()).add(value)


def index_discard(index: dict[K, set[V]], key: K, value: V) -> None:
    """Drop ``value`` from ``key``'s set, and the key with its last value."""
    values = index.get(key)
    if values is not None:
        values.discard(value)
        if not values:
            del index[key]
