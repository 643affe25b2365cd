"""Which members of a round died silently: the survivors' probe after a failed collective.

A node whose processes all die at once (a power loss, a kernel panic, a SIGKILL of its
whole process tree) writes nothing anywhere: its pod may read Running for tens of seconds,
and its member key stands until its lease runs out (``lease_ttl``). Its peers notice first:
their collectives fail, and each survivor's agent reports it in its member record. Every
live agent of the round sees that report and renews its lease at once and then every
0.4 s for a few seconds (``HURRY_EVERY``); meanwhile the reporting survivors read the leases
of the round's other members (from ``JUDGE_AFTER_S`` on, once the live ones have had the
time to renew), and a member whose lease then goes a second without renewal is dead (``regroup.etcd.renewed_within``). The survivor
names it in its member record (``MemberRecord.silent_peers``), and the controller takes a
node so named as lost (``regroup.controller.decide.health``): about a second after the death
instead of a lease TTL after it.

A member that reported a failed collective of its own in the round is alive and is not
probed; nor is one whose key is gone (the controller sees that by itself).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from regroup import etcd
from regroup.keys import JobKeys
from regroup.records import MemberRecord

JUDGE_AFTER_S = 0.6
"""No lease is judged before this long after the failure: the report reaches each live agent
of the round through its watch, and it renews at once (``HURRY_EVERY``). Judged earlier, a
live agent between two of its usual renewals (``lease_ttl``/3 apart) would read as silent."""
PROBE_FOR_S = 1.5
"""How long after the failure the leases are watched: a member dead since then has gone a
second without renewing by then, with room for a slow read."""
PROBE_EVERY_S = 0.25
"""How often the leases are read meanwhile."""
HURRY_EVERY = timedelta(seconds=0.4)
HURRY_FOR = timedelta(seconds=PROBE_FOR_S + 2.0)
"""Every agent of the round renews its lease every ``HURRY_EVERY`` for ``HURRY_FOR`` once it
sees a failure reported in its round (``AgentKeys``): a live agent then always reads as
renewed within the last second while the survivors probe, whatever its usual period
(``lease_ttl``/3, 1.7 s by default)."""


def to_probe(members: Mapping[str, MemberRecord], round: int, me: str) -> list[str]:
    """The members of ``round`` worth probing: not this agent, not one that reported a
    failed collective of its own in the round (it is alive)."""
    return sorted(
        node for node, m in members.items() if m.round == round and node != me and m.peer_failure_round != round
    )


async def find_silent(
    client: Any,
    keys: JobKeys,
    nodes: Iterable[str],
    since: float,
    found: Callable[[list[str]], None],
    clock: Callable[[], float] = time.time,
) -> list[str]:
    """Watch the leases of ``nodes``' member keys until ``PROBE_FOR_S`` after ``since`` (unix
    time of the failed collective), calling ``found`` with all the silent ones so far each time
    more are found; returns them. Raises what etcd raises (``etcd.TRANSIENT_ERRORS``)."""
    wanted = {keys.member(node): node for node in nodes}
    listing = await client.get_prefix(keys.members.encode())  # one read for every member's lease
    leases = {wanted[kv.key.decode()]: int(kv.lease) for kv in listing if kv.key.decode() in wanted and kv.lease}
    silent: list[str] = []
    if leases and (wait := since + JUDGE_AFTER_S - clock()) > 0:
        await asyncio.sleep(wait)
    while leases:
        newly = [node for node, lease in leases.items() if not await etcd.renewed_within(client, lease)]
        if newly:
            for node in newly:
                del leases[node]
            silent = sorted([*silent, *newly])
            found(silent)
        if clock() >= since + PROBE_FOR_S:
            break
        await asyncio.sleep(PROBE_EVERY_S)
    return silent
