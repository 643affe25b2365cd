"""Checkpoint-before-resize through etcd, and prompt stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from regroup.etcd import loop_threads
from regroup.keys import JobKeys
from regroup.records import CheckpointAck, CheckpointRequest, Progress, Record, ReformRequest
from regroup.telemetry import read_spans
from tests.elastic.harness import full_state, torchrun_argv, write_config
from regroup.elastic.checkpoint.folders import COMMIT_MARKER, list_steps, step_dir
from regroup.elastic.settings import EtcdConfig
from regroup.elastic.world.control import JobChannel
from tests.etcd_helpers import put_retrying

pytestmark = pytest.mark.slow

R = TypeVar("R", bound=Record)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
REFORM_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
REFORM_SPAN = "b7ad6b7169203331"




def _event(line: str) -> dict[str, Any] | None:
    """A JSON log event, or None for other output (torchrun's own warnings)."""
    if not line.startswith("{"):
        return None
    try:
        return json.loads(line)
    except ValueError:
        return None


async def wait_record(client: Any, key: str, kind: type[R], predicate: Callable[[R], bool], timeout: float = 60) -> R:
    """The first value of ``key`` that satisfies ``predicate``, from a watch (no polling)."""
    async with asyncio.timeout(timeout):
        found = await client.get_prefix(key.encode())
        for kv in found:
            if kv.key.decode() == key and predicate(record := kind.from_json(kv.value)):
                return record
        watch = await client.watch(key.encode(), start_revision=found.header.revision + 1)
        try:
            async for event in watch:
                if event.kv.value and predicate(record := kind.from_json(event.kv.value)):
                    return record
        finally:
            await watch.cancel()
    raise AssertionError("unreachable")


async def test_checkpoint_request_is_honoured_at_the_next_boundary_acked_held_and_resumed(
    tmp_path: Path, etcd: Any, etcd_client: Any, worker_env: dict[str, str]
) -> None:
    keys = JobKeys("default", "req-job")
    ckpt = tmp_path / "ckpt"
    spans = tmp_path / "spans.jsonl"
    config = write_config(
        tmp_path / "c.yaml",
        checkpoint={"dir": str(ckpt), "at_end": False},
        etcd={"endpoint": etcd.endpoint, "job": keys.job, "progress_interval": "50ms"},
        step_time_floor="300ms",
        max_steps=10_000,
    )
    env = {**worker_env, "REGROUP_SPANS_FILE": str(spans)}
    log_file = (tmp_path / "log").open("w")
    proc = await asyncio.create_subprocess_exec(
        *torchrun_argv(2, config), env=env, stdout=asyncio.subprocess.DEVNULL, stderr=log_file
    )
    try:
        before = await wait_record(etcd_client, keys.progress, Progress, lambda p: p.step >= 4)
        # Four boundaries passed with nothing pending: not one save was started.
        assert before.extra["checkpoint_saves"] == 0
        # How often the record comes, for a reader to tell a quiet run from a stopped one.
        assert before.extra["progress_interval_s"] == 0.05
        assert before.world_size == 2 and before.resumed_from_step == 0

        # etcd restarts under the running job: the trainer re-watches and still hears requests
        # (later than usual: the client's channel reconnects with back-off).
        await asyncio.to_thread(etcd.restart)
        # Without hold: save, ack, train on.
        early = CheckpointRequest(generation=2, deadline=time.time() + 120, hold=False)
        await put_retrying(etcd_client, keys.checkpoint, early.to_json())
        early_ack = await wait_record(etcd_client, keys.ack(2), CheckpointAck, lambda a: True)
        after = await wait_record(etcd_client, keys.progress, Progress, lambda p: p.step >= early_ack.step + 2)
        assert after.extra["state"] == "training"
        assert after.extra["checkpoint_saves"] == 1 and after.extra["requests_honoured"] == 1

        request = CheckpointRequest(
            generation=3,
            deadline=time.time() + 120,
            hold=True,
            reason="node n2 reclaimed",
            traceparent=f"00-{TRACE_ID}-{PARENT_SPAN}-01",
        )
        await etcd_client.put(keys.checkpoint.encode(), request.to_json())
        at_request = await wait_record(etcd_client, keys.progress, Progress, lambda p: True)
        ack = await wait_record(etcd_client, keys.ack(3), CheckpointAck, lambda a: True)
        # Progress is at most one step behind, and the request is seen within a step.
        assert at_request.step <= ack.step <= at_request.step + 2
        assert (ack.generation, ack.world_size, ack.checkpoint_id) == (3, 2, f"step-{ack.step}")
        assert (step_dir(ckpt, ack.step) / COMMIT_MARKER).is_file()

        holding = await wait_record(etcd_client, keys.progress, Progress, lambda p: p.extra["state"] == "holding")
        assert holding.step == ack.step
        assert holding.extra["checkpoint_saves"] == 2 and holding.extra["requests_honoured"] == 2

        stopped_in = await stop_the_workers(proc)  # the agent stops its workers for the re-form
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log_file.close()

    assert stopped_in < 5, f"workers took {stopped_in:.1f}s to stop"
    final = Progress.from_json((await etcd_client.get(keys.progress.encode())).value)
    assert final.step == ack.step, "held at the acked step: no step lost"
    assert final.extra["state"] == "stopped"
    assert list_steps(ckpt) == [(early_ack.step, True), (ack.step, True)]

    checkpoint_spans = [s for s in read_spans(spans) if s["name"] == "regroup.trainer.checkpoint"]
    assert sorted(s["attributes"]["regroup.generation"] for s in checkpoint_spans) == [2, 3]
    (span,) = [s for s in checkpoint_spans if s["attributes"]["regroup.generation"] == 3]
    assert (span["trace_id"], span["parent_span_id"]) == (TRACE_ID, PARENT_SPAN)
    assert span["attributes"]["regroup.step"] == ack.step
    assert span["attributes"]["regroup.generation"] == 3
    assert span["attributes"]["regroup.checkpoint.bytes"] > 0

    # The re-formed job (one rank now) resumes from the acked checkpoint; its resume span
    # joins the re-form's trace.
    reform = ReformRequest(generation=4, cause="reclaim", traceparent=f"00-{REFORM_TRACE_ID}-{REFORM_SPAN}-01")
    await etcd_client.put(keys.reform.encode(), reform.to_json())
    resumed = await asyncio.create_subprocess_exec(
        *torchrun_argv(1, config, f"max_steps={ack.step + 1}", "step_time_floor=0"),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert await asyncio.wait_for(resumed.wait(), 60) == 0
    finally:
        if resumed.returncode is None:
            resumed.kill()
            await resumed.wait()
    final = Progress.from_json((await etcd_client.get(keys.progress.encode())).value)
    assert (final.step, final.resumed_from_step, final.world_size) == (ack.step + 1, ack.step, 1)
    (resume,) = [s for s in read_spans(spans) if s["name"] == "regroup.trainer.resume"]
    assert (resume["trace_id"], resume["parent_span_id"]) == (REFORM_TRACE_ID, REFORM_SPAN)
    assert resume["attributes"]["regroup.resumed_from_step"] == ack.step
    assert resume["attributes"]["regroup.world_size"] == 1


async def sigterm_once(
    config: Path,
    env: dict[str, str],
    until: Callable[[dict[str, Any]], bool],
    settle: Callable[[], Awaitable[object]] | None = None,
) -> tuple[float, list[dict[str, Any]]]:
    """Run a 2-rank job until a log event satisfies ``until`` (then await ``settle``), send
    the agent SIGTERM, and return how long its workers took to stop and the log events."""
    proc = await asyncio.create_subprocess_exec(
        *torchrun_argv(2, config), env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    reached = asyncio.Event()
    lines: list[str] = []

    async def read_log() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            lines.append(raw.decode(errors="replace"))
            event = _event(lines[-1])
            if event is not None and until(event):
                reached.set()

    reader = asyncio.create_task(read_log())
    try:
        await asyncio.wait_for(reached.wait(), 90)
        if settle is not None:
            await settle()
        stopped_in = await stop_the_workers(proc)
        await asyncio.wait_for(reader, 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    return stopped_in, [e for e in map(_event, lines) if e is not None]


async def test_sigterm_mid_training_exits_promptly_without_a_torn_checkpoint(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    ckpt = tmp_path / "ckpt"
    # An async save after every step: a stop almost always lands with a save in flight.
    config = write_config(
        tmp_path / "c.yaml", checkpoint={"dir": str(ckpt), "every_steps": 1, "keep_last": 100}, max_steps=10_000
    )
    stopped_in, events = await sigterm_once(
        config, worker_env, until=lambda e: e.get("event") == "step" and e["step"] >= 6
    )

    assert stopped_in < 5, f"workers took {stopped_in:.1f}s to stop"
    stops = [e for e in events if e.get("event") == "stopping"]
    assert len(stops) == 2, "both ranks stop at the same agreed boundary"
    assert stops[0]["step"] == stops[1]["step"]
    steps = list_steps(ckpt)
    committed = [s for s, ok in steps if ok]
    assert committed and committed[-1] >= 5
    # Only the newest save may be unfinished; every committed one loads in full.
    assert all(ok for s, ok in steps[:-1]), steps
    for step in committed[-2:]:
        state = full_state(ckpt, step, tmp_path)
        assert state["trainer"]["step"] == step


async def test_sigterm_ends_a_rank_blocked_in_a_collective_and_reports_its_last_step(
    tmp_path: Path, etcd: Any, etcd_client: Any, worker_env: dict[str, str]
) -> None:
    keys = JobKeys("default", "hang-job")
    # Rank 1 stops making progress before step 4: rank 0 blocks in step 4's all-gather,
    # where no Python signal handler runs. The stop must still end it, promptly.
    # Progress at every boundary (a step takes longer than 1 ms): step 3's record is written
    # before rank 0 blocks, however close together steps 2 and 3 end on the machine.
    config = write_config(
        tmp_path / "c.yaml",
        etcd={"endpoint": etcd.endpoint, "job": keys.job, "progress_interval": "1ms"},
        faults=[{"kind": "hang", "rank": 1, "step": 4}],
        max_steps=10_000,
    )
    stopped_in, events = await sigterm_once(
        config,
        worker_env,
        until=lambda e: e.get("event") == "fault: hanging before step",
        settle=lambda: wait_record(etcd_client, keys.progress, Progress, lambda p: p.step == 3),
    )

    # Rank 1 waits where no stop is ever looked at: only its watchdog can end it. Rank 0,
    # blocked in the all-gather, ends by its own watchdog or by the collective failing once
    # rank 1 is gone, whichever comes first on the machine; either way within the bound.
    assert stopped_in < 5, f"workers took {stopped_in:.1f}s to stop"
    forced = [e for e in events if e.get("event", "").startswith("training loop did not")]
    assert 1 <= len(forced) <= 2, f"watchdog exits: {forced}"
    final = Progress.from_json((await etcd_client.get(keys.progress.encode())).value)
    assert (final.step, final.extra["state"]) == (3, "stopped")


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; the parent pid follows the closing paren.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


async def _exited(pid: int) -> None:
    """Await the exit of a process that is not our child (pidfd becomes readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    await _pidfd_exit(fd)


async def _pidfd_exit(fd: int) -> None:
    """Await the exit of the process behind ``fd`` (a pidfd, closed here)."""
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_reader(fd, gone.set)
    try:
        await gone.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def stop_the_workers(agent: asyncio.subprocess.Process) -> float:
    """Send the agent of a 2-rank job SIGTERM; seconds until both workers exited, which is
    the stop under test. The agent's own exit after that (torchrun's teardown, seconds on
    a busy machine) is awaited, but not timed."""
    workers = _children(agent.pid)
    assert len(workers) == 2, f"expected 2 workers under the agent, found {workers}"
    fds: list[int] = []
    try:
        for pid in workers:
            fds.append(os.pidfd_open(pid))  # before the signal: no pid can be reused meanwhile
    except ProcessLookupError:
        for fd in fds:
            os.close(fd)
        raise AssertionError(f"a worker of {workers} exited before the stop") from None
    sent = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    await asyncio.wait_for(asyncio.gather(*(_pidfd_exit(fd) for fd in fds)), 30)
    stopped_in = time.monotonic() - sent
    await asyncio.wait_for(agent.wait(), 60)
    return stopped_in


async def test_workers_stop_by_themselves_when_their_agent_is_killed(
    tmp_path: Path, etcd: Any, etcd_client: Any, worker_env: dict[str, str]
) -> None:
    keys = JobKeys("default", "orphan-job")
    config = write_config(
        tmp_path / "c.yaml",
        etcd={"endpoint": etcd.endpoint, "job": keys.job, "progress_interval": "50ms"},
        max_steps=100_000,
    )
    proc = await asyncio.create_subprocess_exec(
        *torchrun_argv(2, config), env=worker_env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    workers: list[int] = []
    try:
        await wait_record(etcd_client, keys.progress, Progress, lambda p: p.step >= 2, timeout=90)
        workers = _children(proc.pid)
        assert len(workers) == 2, f"expected 2 workers under the agent, found {workers}"
        # torchrun's workers run in their own session: killing the agent leaves them running.
        proc.kill()
        await proc.wait()
        await asyncio.wait_for(asyncio.gather(*(_exited(pid) for pid in workers)), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    final = Progress.from_json((await etcd_client.get(keys.progress.encode())).value)
    assert final.extra["state"] == "stopped", "the orphaned workers stopped cleanly and said so"


async def test_the_job_channel_follows_requests_and_leaves_no_loop_thread_behind(etcd: Any, etcd_client: Any) -> None:
    keys = JobKeys("default", "job")

    def progress(step: int) -> Progress:
        return Progress(step=step, loss=1.0, samples_seen=step * 4, world_size=1, time=time.time())

    mark = loop_threads.mark()
    channel = JobChannel(EtcdConfig(endpoint=etcd.endpoint, job="job"))
    await asyncio.to_thread(channel.start)
    try:
        assert channel.request() is None
        request = CheckpointRequest(generation=1, deadline=time.time() + 60)
        await etcd_client.put(keys.checkpoint.encode(), request.to_json())
        async with asyncio.timeout(10):
            while channel.request() != request:  # seen by the watch in the channel's own thread
                await asyncio.sleep(0.05)
        channel.publish_progress(progress(3))
        await asyncio.to_thread(channel.publish_progress, progress(4), True)
        assert Progress.from_json((await etcd_client.get(keys.progress.encode())).value).step == 4
    finally:
        await asyncio.to_thread(channel.close)
    await asyncio.to_thread(channel.close)  # idempotent
    channel.publish_progress(progress(5))  # closed: not written, not raised
    assert loop_threads.open(since=mark) == [] and loop_threads.problems(since=mark) == []
