"""Nothing left behind: once every job ended, what their keys and leases left in etcd,
and what compaction and defragmentation give back.

A finished job's prefix ``/regroup/jobs/<ns>/<job>/`` should be empty once the controller's
retention has passed (its clean-up then writes a tombstone ``/regroup/finished/<ns>/<job>``,
which goes in turn once the job's pods have been gone for the retention), and the lease
count back where it was before the jobs came: every agent's lease revoked on its leave or
run out after its death. With authentication on, the ended jobs' etcd users and roles
(``regroup:job:<ns>:<job>``) should be gone too: the controller removes them once nothing of
the job is left, the tombstone included (asked through the Auth API as a ``root`` user).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench.platform.observe import EtcdGateway
from regroup.etcd.auth import job_of_user
from regroup.keys import JobKeys

LEASE_SETTLE = timedelta(seconds=5)
"""Beyond the agents' lease TTL: how long the dead agents' leases may take to go."""
RETENTION_SETTLE = timedelta(seconds=30)
"""Beyond the retention: how long the controller's clean-up may take to act on it. With
every core of the machine kept busy, a tombstone was still there 10 s past the retention;
the wait ends as soon as all is gone (``settle_s`` says how long it took), so a quiet run
is no slower."""
IDENTITY_SETTLE = timedelta(seconds=30)
"""Beyond the tombstones: how long the controller may take to remove the ended jobs' etcd
users and roles (it does so once it no longer tracks the job)."""


def job_root(namespace: str, job: str) -> str:
    return JobKeys(namespace, job).root


def job_identities_left(gateway: EtcdGateway, namespace: str, ended: list[str]) -> dict[str, list[str]]:
    """The etcd users and roles of the ``ended`` jobs that are still there."""
    ours = {(namespace, job) for job in ended}

    def of_ended(names: list[str]) -> list[str]:
        return sorted(n for n in names if (keys := job_of_user(n)) is not None and (keys.namespace, keys.job) in ours)

    return {"users": of_ended(gateway.users()), "roles": of_ended(gateway.roles())}


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
    retention: timedelta, identities: bool = False,
) -> dict[str, Any]:
    """What the ``ended`` jobs left, once the dead agents' leases had their TTL and the
    controller its ``retention``; then the database before and after compaction and
    defragmentation. ``identities``: authentication is on, and the jobs' etcd users and roles
    are checked too (``identities_left``; None when off)."""
    roots = [job_root(namespace, job) for job in ended]
    waited = await _settle(lambda: gateway.leases() <= leases_start, lease_ttl + LEASE_SETTLE)
    tombstone_keys = [JobKeys(namespace, job).tombstone for job in ended]
    waited += await _settle(
        lambda: not any(gateway.count(key) for key in (*roots, *tombstone_keys)), retention + RETENTION_SETTLE
    )
    if identities:
        waited += await _settle(lambda: not any(job_identities_left(gateway, namespace, ended).values()),
                                IDENTITY_SETTLE)  # fmt: skip
    identities_left = job_identities_left(gateway, namespace, ended) if identities else None
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
        "identities_left": identities_left,
        "settle_s": round(waited, 1),
        "db_bytes_before": db_before,
        "db_in_use_before": in_use_before,
        "db_bytes_after": db_after,
        "db_in_use_after": in_use_after,
        "clean": not dirty and not tombstones and leases_end <= leases_start
        and not (identities_left and any(identities_left.values())),
    }
