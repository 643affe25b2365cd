"""Nothing left behind: once every job ended, what their keys and leases left in etcd,
and what compaction and defragmentation give back.

A finished job's prefix ``/regroup/jobs/<ns>/<job>/`` should be empty once the controller's
retention has passed (its clean-up then writes a tombstone ``/regroup/finished/<ns>/<job>``,
which goes in turn once the job's pods have been gone for the retention), and the lease
count back where it was before the jobs came: every agent's lease revoked on its leave or
run out after its death.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench.platform.observe import EtcdGateway
from regroup.keys import JobKeys

LEASE_SETTLE = timedelta(seconds=5)
"""Beyond the agents' lease TTL: how long the dead agents' leases may take to go."""
RETENTION_SETTLE = timedelta(seconds=30)
"""Beyond the retention: how long the controller's clean-up may take to act on it. With
every core of the machine kept busy, a tombstone was still there 10 s past the retention;
the wait ends as soon as all is gone (``settle_s`` says how long it took), so a quiet run
is no slower."""


def job_root(namespace: str, job: str) -> str:
    return JobKeys(namespace, job).root


def key_kind(rest: str) -> str:
    """``control/plan``, ``acks/``, ``rdzv/rounds/``...: the kind of a key below its job's root."""
    head, _, tail = rest.partition("/")
    if head == "control":
        return rest
    if head == "rdzv":
        return "rdzv/" + (tail.split("/", 1)[0] + ("/" if "/" in tail else ""))
    return head + ("/" if tail else "")


async def _settle(done: Callable[[], bool], timeout: timedelta) -> float:
    """Seconds until ``done()`` held (asked twice a second), at most ``timeout``."""
    started = time.monotonic()
    while not done() and time.monotonic() - started < timeout.total_seconds():
        await asyncio.sleep(0.5)
    return time.monotonic() - started


async def check_leftovers(
    gateway: EtcdGateway, namespace: str, ended: list[str], leases_start: int, lease_ttl: timedelta,
    retention: timedelta,
) -> dict[str, Any]:
    """What the ``ended`` jobs left, once the dead agents' leases had their TTL and the
    controller its ``retention``; then the database before and after compaction and defragmentation."""
    roots = [job_root(namespace, job) for job in ended]
    waited = await _settle(lambda: gateway.leases() <= leases_start, lease_ttl + LEASE_SETTLE)
    tombstone_keys = [JobKeys(namespace, job).tombstone for job in ended]
    waited += await _settle(
        lambda: not any(gateway.count(key) for key in (*roots, *tombstone_keys)), retention + RETENTION_SETTLE
    )
    left = {job: gateway.count(root) for job, root in zip(ended, roots, strict=True)}
    kinds: Counter[str] = Counter()
    for job, root in zip(ended, roots, strict=True):
        if left[job]:
            kinds.update(key_kind(key.removeprefix(root)) for key in gateway.keys(root, limit=left[job]))
    tombstones = sum(gateway.count(key) for key in tombstone_keys)
    leases_end = gateway.leases()
    db_before, in_use_before = gateway.db_size()
    await asyncio.to_thread(gateway.compact_and_defragment)
    db_after, in_use_after = gateway.db_size()
    dirty = sum(1 for n in left.values() if n)
    return {
        "ended_jobs": len(ended),
        "jobs_with_keys": dirty,
        "keys_left": sum(left.values()),
        "key_kinds": dict(sorted(kinds.items())),
        "keys_by_job": left,
        "tombstones": tombstones,
        "leases_start": leases_start,
        "leases_end": leases_end,
        "settle_s": round(waited, 1),
        "db_bytes_before": db_before,
        "db_in_use_before": in_use_before,
        "db_bytes_after": db_after,
        "db_in_use_after": in_use_after,
        "clean": not dirty and not tombstones and leases_end <= leases_start,
    }
