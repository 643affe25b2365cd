"""The demo's recorder against a real etcd: what it writes, and nothing twice across an etcd restart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from regroup.demo.recorder import JobRecorder
from regroup.keys import JobKey, JobKeys
from regroup.records import MemberRecord, Progress
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
