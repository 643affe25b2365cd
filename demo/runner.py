"""Plays one scenario on local nodes and records what happened.

One run: a real etcd, the local cluster (one torchrun agent per node), the controller
(``regroup`` mode) or a standalone c10d store (``torchrun-c10d`` mode), the recorder,
the scripted churn and the live view, all owned by one asyncio task tree that is torn
down, processes included, however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog

from regroup.controller.cluster import NodeInfo
from regroup.demo.local_cluster import LocalCluster
from regroup.demo.live import LiveView, stale_after
from regroup.demo.nodes import (
    CONTROLLED,
    NAMESPACE,
    Mode,
    RunLayout,
    base_env,
    make_launcher,
    pod_annotations,
    write_trainer_config,
)
from regroup.demo.recorder import JobRecorder
from regroup.demo.finished import JobFinished, job_over
from regroup.demo.run_state import FlakyNode, RunState
from regroup.demo.scenario import ChurnEvent, Scenario
from regroup.etcd import EtcdSettings
from regroup.demo.etcd_server import EtcdServer
from regroup.keys import JobKeys
from regroup.records import Progress, ReformPhase

log = structlog.get_logger("demo")

CONTROLLER_READY_TIMEOUT = 60.0
STARTUP_TIMEOUT = 240.0
"""How long the first training step may take to appear (torch imports on a busy machine)."""
SETTLE_TIMEOUT = 180.0
"""How long a scripted event waits at most for the job to settle after the previous one
(a restored node starts its agent and trainer from scratch: torch imports on a busy machine)."""


@dataclass
class Pace:
    """For a user's script that does not report ``resumed_from_step``: the first step each
    flaky node's incarnation was seen at."""

    first_steps: dict[str, int] | None = None
    """Flaky node -> first step seen since its last crash; None: progress reports its resume point."""


def _schedulable(node: NodeInfo) -> bool:
    return not node.unschedulable and not any(t.effect in ("NoSchedule", "NoExecute") for t in node.taints)


def _world_bounds(run: RunState) -> tuple[int, int]:
    """The world sizes the job should train at once settled: every schedulable node (no
    cordon, no reclaim notice) in the world, a flaky node not yet dealt with in it or not;
    a node that died silently (still in the API, gone) not."""
    assert run.cluster is not None
    job = run.scenario.job
    usable = [n.name for n in run.cluster.nodes() if _schedulable(n) and n.name not in run.gone]
    required = [n for n in usable if n not in run.flaky]
    return (
        min(len(required), job.max_nodes) * job.nproc_per_node,
        min(len(usable), job.max_nodes) * job.nproc_per_node,
    )


def _unsettled(run: RunState, final: bool = False) -> str:
    """Why the job is not settled yet, or "" once it is: it trains (fresh progress) in a
    world of every usable node (a node that came back trains in it, not just has an agent
    up: its agent and trainer start from scratch first), and no re-form is in flight. At
    the end of the run (``final``), every flaky node has also been dealt with (cordoned or
    gone) and the job has trained on since, so where the run ends does not depend on the
    machine's speed."""
    view = run.recorder.view if run.recorder else None
    if view is None or view.progress is None:
        return "no progress yet"
    # Progress older than a few of the job's own publishing intervals: it is not training.
    fresh = stale_after(view)
    if time.time() - view.progress_seen_at > fresh:
        return f"no progress for {time.time() - view.progress_seen_at:.0f}s"
    if final and run.cluster is not None:
        for flaky in run.flaky.values():
            node = run.cluster.node(flaky.node)
            if node is not None and not node.unschedulable and not _replaced(run, flaky.node):
                return f"flaky {flaky.node} not cordoned"
            # ... and the job has trained on since it was dealt with, not just re-formed.
            dealt_with = run.dealt_with.setdefault(flaky.node, time.time())
            if view.progress_seen_at < dealt_with + fresh:
                return f"no training since {flaky.node} was dealt with"
    if view.plan is not None and view.plan.phase != ReformPhase.DONE:
        return f"re-form {view.plan.generation} ({view.plan.cause.value}) in phase {view.plan.phase.value}"
    if run.cluster is not None:
        low, high = _world_bounds(run)
        if not low <= view.progress.world_size <= high:
            expected = str(low) if low == high else f"{low} to {high}"
            return f"training at world size {view.progress.world_size}, {expected} expected"
        wanted = _spares_expected(run)
        waiting = view.spares(time.time(), run.scenario.job.max_nodes)
        if len(waiting) < wanted:
            return f"{len(waiting)} of {wanted} spare node(s) waiting to join"
    return ""


def _spares_expected(run: RunState) -> int:
    """How many nodes should wait as spares once settled: the usable nodes beyond the job's
    max, a flaky node not counted (on probation it is no spare, and it is on its way out)."""
    assert run.cluster is not None
    gone = run.flaky.keys() | run.gone
    usable = [n.name for n in run.cluster.nodes() if _schedulable(n) and n.name not in gone]
    return max(0, len(usable) - run.scenario.job.max_nodes)


def _replaced(run: RunState, node: str) -> bool:
    """A spare trains in ``node``'s place: the round formed last leaves it out and the job
    trains at its max. Left waiting, the node no longer crashes and is never cordoned."""
    view = run.recorder.view if run.recorder else None
    if view is None or view.round_state is None or view.progress is None:
        return False
    job = run.scenario.job
    at_max = view.progress.world_size >= job.max_nodes * job.nproc_per_node
    return at_max and node not in view.round_state.nodes


async def _settle(run: RunState, timeout: float, final: bool = False) -> float:
    """Wait until the job settles (at most ``timeout``); returns the seconds waited. Giving
    up is recorded (a ``NotSettled`` event, with why): what follows did not play as written."""
    started = time.time()
    while why := _unsettled(run, final):
        if time.time() - started >= timeout:
            why = f"gave up after {timeout:.0f}s waiting for the job to settle: {why}"
            run.record("demo", "NotSettled", why, type_="Warning")
            break
        await asyncio.sleep(0.2)
    return time.time() - started


async def _wait_settled(run: RunState, timeout: float, final: bool = False) -> None:
    """Push the script back until the job settles (at most ``timeout``), so each event's
    re-form is over before the next one starts on a slow machine too."""
    run.delay += await _settle(run, timeout, final)


async def start_clock(run: RunState, timeout: float = SETTLE_TIMEOUT) -> None:
    """Start the scenario's clock (``run.started_at``). With the controller, once the job has
    trained and settled: every node it starts with in its world and, with spares, its
    spares waiting (a spare node starts once the job trains, and its agent and workers start
    from scratch). So the first event does not wait for the start-up, and the events land at
    their scripted times. Without it (the baseline) at the first step, as the churn waits
    for no job."""
    if run.mode in CONTROLLED:
        await _settle(run, timeout)
    run.started_at = time.time()


async def _play(run: RunState, events: tuple[ChurnEvent, ...]) -> None:
    """Fire each event at its time; with regroup, never before the previous event's re-form is over."""
    assert run.cluster is not None
    for event in events:
        delay = run.started_at + run.delay + event.at.total_seconds() - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if run.mode in CONTROLLED:
            # The baseline plays at the scripted times: churn does not wait for a job to recover.
            await _wait_settled(run, SETTLE_TIMEOUT)
        # Its scripted time beside the played one: the report places it at the YAML's time
        # and says so when a settle pushed it back.
        run.record("scenario", event.action, event.describe(), event.nodes, "Warning", at=event.at.total_seconds())
        run.played += 1
        for node in event.nodes:
            if event.action == "reclaim":
                if run.cluster.node(node) is not None:
                    await run.cluster.reclaim_notice(node, event.taint, event.notice)
            elif event.action == "evict":
                if run.cluster.node(node) is not None:
                    await run.cluster.evict(node, event.notice)
            elif event.action == "drain":
                if run.cluster.node(node) is not None:
                    await run.cluster.drain(node, event.notice)
            elif event.action == "uncordon":
                if run.cluster.node(node) is not None:
                    await run.cluster.uncordon(node)
            elif event.action == "lose":
                if run.cluster.node(node) is not None:
                    run.gone.add(node)
                    await run.cluster.remove_node(node, reason="lost abruptly (SIGKILL)")
            elif event.action == "vanish":
                if run.cluster.node(node) is not None and node not in run.gone:
                    run.gone.add(node)
                    await run.cluster.silence_node(node)
            elif event.action == "restore":
                if node in run.gone and run.cluster.node(node) is not None:
                    # It died silently: its node and pod still stand in the API. Gone for good now.
                    await run.cluster.remove_node(node, reason="replaced after dying silently")
                if run.cluster.node(node) is None:
                    run.gone.discard(node)
                    await run.cluster.add_node(node)
            elif event.action == "flaky":
                run.flaky[node] = FlakyNode(node, event.crash_after_steps)


def _inject_faults(run: RunState, progress: Progress, pace: Pace | None = None) -> None:
    """Crash the flaky nodes' ranks once the job is far enough into an incarnation."""
    now = time.time()
    for flaky in run.flaky.values():
        if flaky.crash_after_steps == 0:
            continue
        # Only progress written after the last crash counts: it comes from a newer incarnation.
        if progress.time < flaky.last_crash + 2.0:
            continue
        # ... and only while the node trains in the world the progress comes from (with
        # in-place re-forms the others train on without it while it is on probation).
        member = run.recorder.view.members.get(flaky.node) if run.recorder else None
        if progress.round and (member is None or member.round != progress.round):
            continue
        resumed_from = progress.resumed_from_step
        if pace is not None and pace.first_steps is not None and not resumed_from:
            # A script that does not report its resume point: count from the first step seen.
            resumed_from = pace.first_steps.setdefault(flaky.node, progress.step)
        if progress.step - resumed_from < flaky.crash_after_steps:
            continue
        if _crash(run, flaky, now, f"at step {progress.step}") and pace is not None and pace.first_steps is not None:
            pace.first_steps.pop(flaky.node, None)


async def _crash_at_start(run: RunState, period: float = 0.1) -> None:
    """Flaky nodes with ``crash_after_steps: 0`` lose their rank as soon as it appears."""
    while True:
        await asyncio.sleep(period)
        for flaky in run.flaky.values():
            if flaky.crash_after_steps == 0:
                _crash(run, flaky, time.time(), "at start")


def _crash(run: RunState, flaky: FlakyNode, now: float, when: str) -> bool:
    """Kill the flaky node's ranks; whether there were any."""
    assert run.cluster is not None
    if run.cluster.crash_workers(flaky.node):
        flaky.last_crash = now
        flaky.crashes += 1
        run.record(
            "fault", "RankCrashed", f"{flaky.node}: rank killed {when} (crash #{flaky.crashes})", (flaky.node,), "Warning"
        )
        return True
    return False


@contextlib.asynccontextmanager
async def owned_task(coro: Any, name: str) -> AsyncIterator[asyncio.Task[Any]]:
    """A task that is cancelled and awaited when the block ends, however it ends."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await task
            except Exception as exc:  # noqa: BLE001 - logged, the run is ending anyway
                log.error("task failed", task=name, error=repr(exc))


async def _start_c10d_store(layout: RunLayout) -> tuple[asyncio.subprocess.Process, str]:
    # Port 0: the store binds a port of its own and says which ("ready PORT").
    log_file = open(layout.logs / "c10d-store.log", "ab")  # noqa: SIM115, ASYNC230 - a local log, closed below
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "regroup.demo.c10d_store", "0",
            env=base_env(layout), stdout=asyncio.subprocess.PIPE, stderr=log_file, start_new_session=True,
        )  # fmt: skip
    finally:
        log_file.close()
    assert process.stdout is not None
    async with asyncio.timeout(60):
        line = await process.stdout.readline()
    said = line.split()
    if len(said) != 2 or said[0] != b"ready" or not said[1].isdigit():
        await process.wait()
        raise RuntimeError(f"c10d store did not start (see {layout.logs / 'c10d-store.log'})")
    return process, f"127.0.0.1:{int(said[1])}"


async def _stop_process(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        try:
            async with asyncio.timeout(5):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


async def await_vital(awaitable: Any, vital: list[asyncio.Task[Any]], timeout: float, what: str) -> None:
    """Await ``awaitable`` for at most ``timeout`` seconds; fail at once if a vital task ends."""
    waiter = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({waiter, *vital}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
    for task in vital:
        if task in done:
            error = task.exception()
            if isinstance(error, JobFinished):
                raise error
            raise RuntimeError(f"{task.get_name()} stopped while waiting for {what}: {error!r}") from error
    if waiter not in done:
        raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what}")


def controller_available() -> bool:
    """Whether this install has the controller runtime (the slim agent-only install has not)."""
    return importlib.util.find_spec("regroup.controller.runtime") is not None


async def _controller(cluster: LocalCluster, etcd: EtcdSettings, ready: asyncio.Event) -> None:
    # Imported here: the baseline mode runs without the controller.
    from regroup.controller.runtime import run_controller
    from regroup.controller.settings import ControllerSettings

    await run_controller(ControllerSettings(), cluster, cluster, etcd, ready=ready)


def _latest_checkpoint(root: Path) -> int | None:
    # Imported here: it brings torch, which only the end of a run needs.
    from regroup.elastic.checkpoint.folders import latest_committed

    return latest_committed(root) if root.is_dir() else None


async def run_scenario(
    scenario: Scenario,
    mode: Mode,
    layout: RunLayout,
    *,
    stream: TextIO | None = None,
    live: bool | None = None,
    script: Sequence[str] | None = None,
) -> RunLayout:
    """Play ``scenario`` in ``mode`` and record it under ``layout``; returns the layout.

    ``live``: draw the live view (None: only on a terminal; False: one line a second).
    ``script``: what each rank runs instead of the built-in trainer (torchrun's training
    command, see ``regroup.demo.nodes.worker_command``); the scenario's ``trainer:``
    section is then unused.
    """
    layout.logs.mkdir(parents=True, exist_ok=True)
    run = RunState(scenario, mode, layout)
    pace = Pace(first_steps={} if script else None)
    etcd = EtcdServer(data_dir=layout.root / "etcd-data", log_path=layout.logs / "etcd.log")
    await asyncio.to_thread(etcd.start)
    store: asyncio.subprocess.Process | None = None
    try:
        settings = EtcdSettings.from_endpoint_string(etcd.endpoint)
        keys = JobKeys(NAMESPACE, scenario.job.name)
        run.recorder = JobRecorder(
            settings, keys, layout.progress, layout.members, layout.root / "plans.jsonl", layout.rounds
        )
        rdzv_endpoint = etcd.endpoint
        if mode == "torchrun-c10d":
            store, rdzv_endpoint = await _start_c10d_store(layout)
        config = None if script else write_trainer_config(scenario, layout, etcd.endpoint)
        layout.checkpoints.mkdir(parents=True, exist_ok=True)
        layout.samples.mkdir(parents=True, exist_ok=True)
        annotations = pod_annotations(scenario, etcd.endpoint)
        launcher = make_launcher(scenario, mode, layout, rdzv_endpoint, config, worker=script, etcd_endpoint=etcd.endpoint)
        run.cluster = LocalCluster(
            NAMESPACE, scenario.job.name, annotations, launcher, on_event=run.on_cluster_event
        )  # fmt: skip
        run.recorder.view.progress_listeners.append(lambda p: _inject_faults(run, p, pace))
        async with contextlib.AsyncExitStack() as stack:
            # Tasks whose early end (a crash) ends the run with an error instead of a silent stall.
            vital = [await stack.enter_async_context(owned_task(run.recorder.run(), "recorder"))]
            if mode in CONTROLLED and not controller_available():
                run.record("demo", "NoController", "regroup.controller.runtime is not installed: agents re-form on their own")
            elif mode in CONTROLLED:
                ready = asyncio.Event()
                controller = await stack.enter_async_context(
                    owned_task(_controller(run.cluster, settings, ready), "controller")
                )
                vital.append(controller)
                await await_vital(ready.wait(), vital, CONTROLLER_READY_TIMEOUT, "the controller to be ready")
            # A job that finished (its agents exit 0, its pods are replaced and exit 0 again)
            # never trains again: the run stops at once, saying where it was.
            vital.append(await stack.enter_async_context(owned_task(job_over(run, bool(script)), "job-over")))
            stack.push_async_callback(run.cluster.stop)
            trained = asyncio.Event()
            run.recorder.view.progress_listeners.append(lambda _: trained.set())
            run.launched_at = time.time()
            # The job forms from the first max_nodes nodes; the others start once it trains
            # and wait as its spares, so the nodes the script names are the ones training.
            forming, spares = scenario.nodes[: scenario.job.max_nodes], scenario.nodes[scenario.job.max_nodes :]
            for node in forming:
                await run.cluster.add_node(node)
            out = stream or sys.stdout
            view = LiveView(run.snapshot, stream=out, tty=out.isatty() if live is None else live)
            await stack.enter_async_context(owned_task(view.run(), "live-view"))
            try:
                await await_vital(trained.wait(), vital, STARTUP_TIMEOUT, "the first training step")
            except TimeoutError as exc:
                if not script:
                    raise
                raise TimeoutError(
                    f"{exc}: no progress record in etcd; a script must publish progress through "
                    f"regroup.elastic (see docs/demo.md, 'Your own script'); its output is in {layout.logs}"
                ) from None
            run.trained_at = time.time()
            for node in spares:
                await run.cluster.add_node(node)
            await await_vital(start_clock(run), vital, SETTLE_TIMEOUT + 60, "the job to settle")
            await stack.enter_async_context(owned_task(_crash_at_start(run), "faults"))
            player = await stack.enter_async_context(owned_task(_play(run, scenario.events), "scenario"))
            # The run lasts its duration plus whatever the script was pushed back, and ends
            # once the last event's re-form is over (or the settle time ran out).
            while True:
                remaining = run.started_at + run.delay + scenario.duration.total_seconds() - time.time()
                if remaining <= 0 and player.done():
                    break
                with contextlib.suppress(TimeoutError):
                    await await_vital(asyncio.Event().wait(), vital, max(0.5, min(remaining, 1.0)), "the end of the run")
            if player.exception() is not None:
                raise RuntimeError(f"the scenario failed: {player.exception()!r}") from player.exception()
            if mode in CONTROLLED:
                await await_vital(
                    _wait_settled(run, SETTLE_TIMEOUT, final=True), vital, SETTLE_TIMEOUT + 60, "the job to settle"
                )
            ended_at = time.time()
            view.draw()
    finally:
        if store is not None:
            await _stop_process(store)
        await asyncio.to_thread(etcd.stop)
    meta = {
        "mode": mode,
        "script": list(script) if script else None,
        "latest_checkpoint_step": await asyncio.to_thread(_latest_checkpoint, layout.checkpoints),
        "scenario": scenario.name,
        "job": scenario.job.name,
        "nodes": list(scenario.nodes),
        "min_nodes": scenario.job.min_nodes,
        "max_nodes": scenario.job.max_nodes,
        "nproc_per_node": scenario.job.nproc_per_node,
        "duration": scenario.duration.total_seconds(),
        "launched_at": run.launched_at,
        "trained_at": run.trained_at,
        "started_at": run.started_at,
        "ended_at": ended_at,
        "script_delay": run.delay,
        "events": [
            {"at": e.at.total_seconds(), "action": e.action, "nodes": list(e.nodes), "description": e.describe()}
            for e in scenario.events
        ],
        "flaky_crashes": {name: f.crashes for name, f in run.flaky.items()},
    }
    layout.meta.write_text(json.dumps(meta, indent=2))
    return layout
