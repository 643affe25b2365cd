"""The survivors' probe after a failed collective (``regroup.rendezvous.silent``), on a real
etcd: a member whose agent stopped renewing its lease is named within about a second of
its last renewal, long before the lease's TTL; live members, members that reported a
failure of their own, and members already gone are not."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from regroup.etcd import LeaseKeeper, renewed_within
from regroup.keys import JobKeys
from regroup.records import MemberRecord
from regroup.rendezvous.silent import HURRY_EVERY, HURRY_FOR, JUDGE_AFTER_S, PROBE_FOR_S, find_silent, to_probe

KEYS = JobKeys("ml", "llm")
TTL = timedelta(seconds=5)


def member(node: str, round_: int = 3, failed_round: int = 0) -> MemberRecord:
    return MemberRecord(node=node, pod=f"llm-{node}", namespace="ml", round=round_, local_world_size=1,
                        peer_failure_round=failed_round)  # fmt: skip


def test_the_probe_skips_itself_other_rounds_and_members_that_reported_a_failure() -> None:
    members = {
        "a": member("a"), "b": member("b"), "c": member("c", failed_round=3), "d": member("d", round_=2),
        "e": member("e", failed_round=2),
    }  # fmt: skip
    assert to_probe(members, 3, "a") == ["b", "e"]


async def test_a_member_that_stopped_renewing_is_named_within_a_second_the_live_ones_never(etcd_client: Any) -> None:
    live = [LeaseKeeper(etcd_client, TTL) for _ in range(2)]
    for keeper in live:
        await keeper.start()
        keeper.hurry(HURRY_EVERY, HURRY_FOR)  # as its agent does on seeing the failure reported
    dead = await etcd_client.lease(int(TTL.total_seconds()))  # its holder died: nobody renews it
    try:
        for node, lease in (("b", live[0].lease), ("c", live[1].lease), ("d", dead)):
            await etcd_client.put(KEYS.member(node).encode(), member(node).to_json(), lease=lease)
        died_at = time.time()
        reports: list[list[str]] = []
        silent = await find_silent(etcd_client, KEYS, ["b", "c", "d", "gone"], died_at, reports.append)
        assert silent == ["d"] and reports == [["d"]]
        assert time.time() - died_at >= PROBE_FOR_S, "the live ones are watched for the whole probe"
        # Named within the probe, about a second after its last renewal: its key still stands
        # (the lease's TTL, 5 s, has not run out).
        assert await etcd_client.get(KEYS.member("d").encode()) is not None
    finally:
        for keeper in live:
            await keeper.stop()
        await etcd_client.revoke_lease(dead.id)


async def test_a_probe_of_live_members_only_finds_nobody(etcd_client: Any) -> None:
    keeper = LeaseKeeper(etcd_client, TTL)
    await keeper.start()
    keeper.hurry(HURRY_EVERY, HURRY_FOR)
    try:
        await etcd_client.put(KEYS.member("b").encode(), member("b").to_json(), lease=keeper.lease)
        found: list[list[str]] = []
        assert await find_silent(etcd_client, KEYS, ["b"], time.time(), found.append) == [] and found == []
    finally:
        await keeper.stop()


async def test_a_live_member_between_two_renewals_is_not_named_if_it_hurries_once_told(etcd_client: Any) -> None:
    # Its usual renewals are lease_ttl/3 apart: at the failure it last renewed over a second
    # ago and reads as silent. Its agent sees the report through its watch and renews at once,
    # a moment later: the probe judges only after that.
    keeper = LeaseKeeper(etcd_client, TTL)
    await keeper.start()
    try:
        await etcd_client.put(KEYS.member("b").encode(), member("b").to_json(), lease=keeper.lease)
        while await renewed_within(etcd_client, keeper.id):
            await asyncio.sleep(0.1)  # until its last renewal is over a second old
        failed_at = time.time()
        asyncio.get_running_loop().call_later(JUDGE_AFTER_S / 3, keeper.hurry, HURRY_EVERY, HURRY_FOR)
        found: list[list[str]] = []
        assert await find_silent(etcd_client, KEYS, ["b"], failed_at, found.append) == [] and found == []
    finally:
        await keeper.stop()
