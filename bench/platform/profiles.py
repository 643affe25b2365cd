"""Where the CPU went: etcd's pprof CPU profile and py-spy's samples of a Python process,
each as its top functions by own (self) and cumulative share.

etcd's profile is a gzipped ``profile.proto`` (github.com/google/pprof, ``proto/profile.proto``);
the few fields read here are decoded by hand, so reading it needs no Go toolchain. py-spy
(``pip install py-spy``; optional) samples a process from outside, every thread, without
slowing it the way an in-process profiler would.
"""

from __future__ import annotations

import asyncio
import gzip
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HotSpot:
    function: str
    self_share: float
    """Fraction of the samples whose innermost frame is this function."""
    total_share: float
    """Fraction of the samples with this function anywhere on the stack."""


@dataclass(frozen=True)
class Ranking:
    by_self: list[HotSpot]
    """The functions the samples were in, most first."""
    by_total: list[HotSpot]
    """The functions the samples were under, most first, leaving out the roots that
    nearly every sample is under (``runtime.goexit``...) and, for Python, the standard
    library's (the event loop, threads): what is left says whose work it was."""
    samples: int


ROOT_SHARE = 0.9
"""A function under at least this share of the samples is a root, not a place where time goes."""


def _rank(stacks: list[tuple[list[str], int]], top: int, samples: int, plumbing: frozenset[str] = frozenset()) -> Ranking:
    """Stacks are innermost frame first, each with its weight; ``plumbing`` frames are left
    out of ``by_total``."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    weight = sum(w for _, w in stacks) or 1
    for frames, w in stacks:
        if frames:
            own[frames[0]] += w
        for frame in set(frames):
            total[frame] += w
    by_self = [HotSpot(f, own[f] / weight, total[f] / weight) for f, _ in own.most_common(top)]
    under = [(f, t) for f, t in total.most_common() if t / weight < ROOT_SHARE and f not in plumbing][:top]
    return Ranking(by_self, [HotSpot(f, own[f] / weight, t / weight) for f, t in under], samples)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one protobuf message: ints for varints, bytes for the rest."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value
        elif wire == 2:
            size, at = _varint(data, at)
            yield number, data[at : at + size]
            at += size
        elif wire == 1:
            yield number, data[at : at + 8]
            at += 8
        elif wire == 5:
            yield number, data[at : at + 4]
            at += 4
        else:
            raise ValueError(f"profile.proto: wire type {wire} not expected")


def _ints(value: int | bytes) -> list[int]:
    """A repeated integer field: one varint, or a packed run of them."""
    if isinstance(value, int):
        return [value]
    out, at = [], 0
    while at < len(value):
        number, at = _varint(value, at)
        out.append(number)
    return out


def pprof_hotspots(profile: bytes, top: int = 12) -> Ranking:
    """The ``top`` functions of a Go CPU profile (weighted by CPU time)."""
    data = gzip.decompress(profile) if profile[:2] == b"\x1f\x8b" else profile
    strings: list[str] = []
    sample_types: list[int] = []
    samples: list[tuple[list[int], list[int]]] = []
    locations: dict[int, list[int]] = {}
    functions: dict[int, int] = {}
    for number, value in _fields(data):
        if number == 6:
            assert isinstance(value, bytes)
            strings.append(value.decode(errors="replace"))
        elif number == 1:
            assert isinstance(value, bytes)
            sample_types.append(next(int(v) for n, v in _fields(value) if n == 1))  # type: ignore[arg-type]
        elif number == 2:
            assert isinstance(value, bytes)
            ids: list[int] = []
            values: list[int] = []
            for n, v in _fields(value):
                if n == 1:
                    ids += _ints(v)
                elif n == 2:
                    values += _ints(v)
            samples.append((ids, values))
        elif number == 4:
            assert isinstance(value, bytes)
            loc_id, lines = 0, []
            for n, v in _fields(value):
                if n == 1:
                    loc_id = int(v)  # type: ignore[arg-type]
                elif n == 4:
                    assert isinstance(v, bytes)
                    lines += [int(fv) for fn, fv in _fields(v) if fn == 1]  # type: ignore[arg-type]
            locations[loc_id] = lines
        elif number == 5:
            assert isinstance(value, bytes)
            fields = dict(_fields(value))
            functions[int(fields.get(1, 0))] = int(fields.get(2, 0))  # type: ignore[arg-type]
    names = [strings[i] if i < len(strings) else "?" for i in sample_types]
    column = names.index("cpu") if "cpu" in names else len(names) - 1

    def name(function_id: int) -> str:
        index = functions.get(function_id, 0)
        return strings[index] if index < len(strings) else "?"

    stacks = []
    for ids, values in samples:
        frames = [name(f) for loc in ids for f in locations.get(loc, [])]
        stacks.append((frames, values[column] if column < len(values) else 0))
    return _rank(stacks, top, len(samples))


def py_spy() -> str | None:
    """py-spy next to this interpreter, or on PATH; None when not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def py_spy_record(pid: int, seconds: int, out: Path) -> subprocess.Popen[bytes] | None:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (collapsed stacks); None without py-spy."""
    binary = py_spy()
    if binary is None:
        return None
    # --gil: only the thread holding the GIL is sampled, i.e. Python at work, not threads
    # waiting in epoll or on a condition.
    command = [binary, "record", "--pid", str(pid), "--duration", str(seconds), "--format", "raw", "--gil",
               "--nonblocking", "--output", str(out)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def collapsed_hotspots(path: Path, top: int = 12) -> Ranking:
    """py-spy's collapsed stacks (``outer;...;inner count`` per line), ranked."""
    stacks = []
    plumbing: set[str] = set()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for frame in stack.split(";"):
            function, _, place = frame.partition(" (")
            file = place.rsplit(":", 1)[0]  # py-spy names it from its package: asyncio/events.py
            name = f"{function} ({file})" if place else function
            if file.startswith("<frozen") or file.split("/")[0].removesuffix(".py") in sys.stdlib_module_names:
                plumbing.add(name)
            frames.append(name)
        stacks.append((frames[::-1], int(count)))
    return _rank(stacks, top, sum(c for _, c in stacks), frozenset(plumbing))


def _ranking(ranking: Ranking) -> dict[str, Any]:
    return {
        "samples": ranking.samples,
        "by_self": [h.__dict__ for h in ranking.by_self],
        "by_total": [h.__dict__ for h in ranking.by_total],
    }


async def record_profiles(etcd_profile: Callable[[int], bytes], pythons: dict[str, int], seconds: int, root: Path) -> dict[str, Any]:
    """etcd's CPU profile (``etcd_profile(seconds)``) and py-spy of each of ``pythons`` (name:
    pid), all over the same ``seconds``; ranked, and kept raw in ``root``."""
    spies = {name: (py_spy_record(pid, seconds, root / f"{name}.pyspy"), root / f"{name}.pyspy") for name, pid in pythons.items()}
    raw = await asyncio.to_thread(etcd_profile, seconds)
    (root / "etcd.pprof").write_bytes(raw)
    out: dict[str, Any] = {"etcd": _ranking(pprof_hotspots(raw))}
    for name, (process, path) in spies.items():
        if process is None:
            out[name] = {"samples": 0, "by_self": [], "by_total": [], "note": "py-spy not installed (pip install py-spy)"}
            continue
        await asyncio.to_thread(process.wait)
        if not path.exists():
            out[name] = {"samples": 0, "by_self": [], "by_total": [], "note": f"py-spy exited {process.returncode}"}
            continue
        out[name] = _ranking(collapsed_hotspots(path))
    return out
