"""The demo's recorder against a real etcd: what it writes, and nothing twice across an etcd restart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from regroup.demo.recorder import JobRecorder, JobView
from regroup.keys import JobKey, JobKeys, KeyKind
from regroup.records import Exclusions, JoinRecord, MemberRecord, Progress, RoundState
from tests.changes import Changes
from tests.etcd_helpers import put_retrying

KEYS = JobKeys("ns", "llama")


class Recorder(JobRecorder):
    """The recorder, telling the test each time it applied a change."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.applied = Changes()
        self.until = self.applied.until

    def _apply(self, found: JobKey) -> None:
        super()._apply(found)
        self.applied.changed()


def member(node: str) -> bytes:
    return MemberRecord(node=node, pod=f"llama-{node}", namespace="ns", round=1, local_world_size=1).to_json()


def progress(step: int) -> bytes:
    return Progress(step=step, loss=1.0, samples_seen=step * 8, world_size=2, time=float(step)).to_json()


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []




async def test_an_etcd_restart_records_what_changed_and_nothing_twice(tmp_path, etcd, etcd_settings, etcd_client) -> None:
    files = tmp_path / "progress.jsonl", tmp_path / "members.jsonl", tmp_path / "plans.jsonl"
    await etcd_client.put(KEYS.member("n1").encode(), member("n1"))
    await etcd_client.put(KEYS.member("n2").encode(), member("n2"))
    recorder = Recorder(etcd_settings, KEYS, *files)
    task = asyncio.create_task(recorder.run())
    try:
        await recorder.until(lambda: set(recorder.view.members) == {"n1", "n2"})
        await etcd_client.put(KEYS.progress.encode(), progress(1))
        await recorder.until(lambda: recorder.view.progress is not None)

        await asyncio.to_thread(etcd.restart)
        # The recorder lists the job again after the restart; whether these land before or
        # after that listing, each is recorded once, and what was recorded before is not again.
        await put_retrying(etcd_client, KEYS.progress, progress(2))
        await etcd_client.delete(KEYS.member("n2").encode())
        await recorder.until(lambda: set(recorder.view.members) == {"n1"} and recorder.view.progress.step == 2)
        await etcd_client.put(KEYS.progress.encode(), progress(3))
        await recorder.until(lambda: recorder.view.progress.step == 3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [p["step"] for p in lines(files[0])] == [1, 2, 3]
    assert [m["nodes"] for m in lines(files[1])] == [["n1"], ["n1", "n2"], ["n1"]]


def join(node: str, round_: int, not_before: float = 0.0) -> JoinRecord:
    return JoinRecord(node=node, agent=f"{node}@1.0", round=round_, host="h", joined_at=1.0, not_before=not_before)


def round_state(round_: int, nodes: list[str]) -> RoundState:
    return RoundState(min_nodes=2, max_nodes=4, round=round_, nodes=nodes, agents=[f"{n}@1.0" for n in nodes])


def test_a_spare_is_a_node_waiting_outside_a_round_at_max() -> None:
    view = JobView(round_state=round_state(3, ["n1", "n2", "n5", "n4"]))
    view.joins = {n: join(n, 4) for n in ("n1", "n2", "n3", "n6", "n7")}
    view.joins["n7"] = join("n7", 4, not_before=100.0)  # on probation after its workers failed
    view.excluded = frozenset({"n6"})  # under a reclaim notice
    assert view.waiting(now=50.0) == ["n3"]
    assert view.spares(now=50.0, max_nodes=4) == ["n3"]
    assert view.spares(now=150.0, max_nodes=4) == ["n3", "n7"]
    # Below max, a waiting node is a joiner the job grows by, not a spare.
    assert view.spares(now=50.0, max_nodes=5) == []


async def test_the_recorder_follows_rounds_joins_and_exclusions(tmp_path, etcd, etcd_settings, etcd_client) -> None:
    files = tmp_path / "progress.jsonl", tmp_path / "members.jsonl", tmp_path / "plans.jsonl", tmp_path / "rounds.jsonl"
    recorder = Recorder(etcd_settings, KEYS, *files)
    task = asyncio.create_task(recorder.run())
    state = KEYS.key(KeyKind.ROUND_STATE).encode()
    try:
        await etcd_client.put(state, round_state(1, ["n1", "n2"]).to_json())
        await etcd_client.put(KEYS.key(KeyKind.JOIN, node="n3").encode(), join("n3", 2).to_json())
        await recorder.until(lambda: recorder.view.spares(1e12, 2) == ["n3"])
        await etcd_client.put(KEYS.excluded.encode(), Exclusions(nodes={"n3": "spot-itn"}).to_json())
        await recorder.until(lambda: recorder.view.waiting(1e12) == [])
        await etcd_client.delete(KEYS.excluded.encode())
        await recorder.until(lambda: recorder.view.waiting(1e12) == ["n3"])
        # n2 is lost; n3 takes its position in round 2. The same round written again is not a new one.
        await etcd_client.put(state, round_state(2, ["n1", "n3"]).to_json())
        await etcd_client.put(state, round_state(2, ["n1", "n3"]).to_json())
        await etcd_client.delete(KEYS.key(KeyKind.JOIN, node="n3").encode())
        await recorder.until(lambda: recorder.view.joins == {} and recorder.view.round_state.round == 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [(r["round"], r["nodes"]) for r in lines(files[3])] == [(1, ["n1", "n2"]), (2, ["n1", "n3"])]
