"""``--costs``: the CPU cost of the storm's common events on one 50-node job, and of the
whole storm replayed with every decision it asks for (no folding, no event loop)."""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable
from typing import Any

from regroup.controller.cluster import NodeInfo, Taint
from regroup.controller.decide import decide
from regroup.keys import JobKeys

from .direct import DirectFeed, direct_harness
from .storm import NAMESPACE, Layout, member, pod_info, replayed


async def run_costs(layout: Layout, storm_events: int = 20_000, seed: int = 8) -> dict[str, Any]:
    """Best of 15 x N calls: the model update plus the snapshot the next decision takes,
    and ``decide`` itself."""
    h = await direct_harness(layout, 1)
    await h.stop()
    m, settings, j = h.model, h.settings, 7
    job = (NAMESPACE, layout.job(j))
    keys = JobKeys(NAMESPACE, layout.job(j), settings.etcd_prefix)
    other = layout.job_nodes(j)[5]

    def best(fn: Callable[[], None], number: int = 200) -> float:
        return round(min(timeit.repeat(fn, number=number, repeat=15)) / number * 1e6, 1)

    def decision() -> None:
        decide(m.snapshot(job), time.time(), settings)

    costs: dict[str, Any] = {"path": "costs (us per call)", "decide_steady_us": best(decision)}
    tainted = layout.job_nodes(j)[3]
    m.node_changed(NodeInfo(tainted, taints=(Taint("karpenter.sh/disrupted"),)))
    costs["decide_one_tainted_node_us"] = best(decision)
    m.node_changed(NodeInfo(tainted))
    restarts = iter(range(1, 10**9))

    def pod_restart() -> None:
        m.pod_changed(pod_info(layout, j, other, next(restarts)))
        m.snapshot(job)

    costs["pod_restart_and_snapshot_us"] = best(pod_restart)
    records = [member(layout, j, other, k) for k in range(1500)]
    ranks = iter(range(10**9))

    def rank_restart() -> None:
        m.etcd_put(keys.member(other), records[next(ranks) % len(records)], 2)
        m.snapshot(job)

    costs["rank_restart_and_snapshot_us"] = best(rank_restart, 100)

    def pod_delete_create() -> None:
        m.pod_deleted(NAMESPACE, layout.pod(j, other))
        m.snapshot(job)
        m.pod_changed(pod_info(layout, j, other))
        m.snapshot(job)

    costs["pod_delete_or_create_and_snapshot_us"] = round(best(pod_delete_create, 50) / 2, 1)
    return {**costs, **await storm_replay(layout, storm_events, seed)}


async def storm_replay(layout: Layout, count: int, seed: int) -> dict[str, Any]:
    """The storm fed one event at a time, every job it wakes decided before the next.

    A paced run at a rate the core cannot serve unfolded is saturated: how many signals
    each decision folds moves from run to run, and its p99 with it (by a third). Here each
    event gets every decision it asks for, so the decisions are the same in every run
    and the CPU per event is the controller's cost of the storm, loop overhead aside: the
    share of a core that a rate needs before any folding (rate x cost per event)."""
    h = await direct_harness(layout, 0)  # no workers: the queue is drained here
    feed = DirectFeed(h, layout)
    events = replayed(layout, h.settings.etcd_prefix, count, seed)
    intake = 0.0
    cpu = time.process_time()
    for event in events:
        began = time.process_time()
        feed(event)
        intake += time.process_time() - began
        await h.decide_queued()
    cpu = time.process_time() - cpu
    await h.stop()
    return {
        "storm_events": count,
        "storm_decisions_per_event": round(h.decisions / count, 3),
        "storm_us_per_event": round(cpu / count * 1e6, 1),
        "storm_intake_us_per_event": round(intake / count * 1e6, 1),
        "storm_us_per_decision": round((cpu - intake) / h.decisions * 1e6, 1),
    }

