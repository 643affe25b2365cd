"""When the model first saw each signal: a job's own sightings joined with its nodes'.

The moment a signal is first seen starts a re-form's ``detect`` phase and, for a taint
without ``timeAdded``, its notice. Node signals (taints, NotReady, cordon, deletion) are
kept once for the fleet; a job's own (a lost member, a joiner, a deleted pod, an ack) by
the job. Keys are ``signals.signal_key(node, what)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from regroup.controller.signals import signal_key


class FirstSeen(Mapping[str, float]):
    """A read-only view joining a job's own sightings with its nodes' (no copying per decision)."""

    def __init__(self, job: Mapping[str, float], nodes: Mapping[str, Mapping[str, float]]) -> None:
        self._job = job
        self._nodes = nodes

    def __getitem__(self, key: str) -> float:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        value = self._job.get(key)
        if value is not None:
            return value
        node, sep, what = key.partition("\x00")
        if sep:
            signals = self._nodes.get(node)
            if signals is not None:
                return signals.get(what, default)
        return default

    def __iter__(self) -> Iterator[str]:
        yield from self._job
        for node, signals in self._nodes.items():
            for what in signals:
                yield signal_key(node, what)

    def __len__(self) -> int:
        return len(self._job) + sum(len(s) for s in self._nodes.values())
