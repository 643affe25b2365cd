"""Job-level alerts that do not change what is re-formed: a rendezvous pod on a GPU node,
and rendezvous rounds flapping."""

from __future__ import annotations

from collections.abc import Iterable

from regroup.controller.cluster import PodInfo
from regroup.controller.decide.out import Out
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import JobSnapshot, PostEvent


def rendezvous_on_gpu(s: JobSnapshot, pods: Iterable[PodInfo], out: Out) -> bool:
    """Warn on each of the job's rendezvous ``pods`` that runs on a GPU node; whether any does."""
    alert = False
    for pod in pods:
        if pod.node is None:
            continue
        node = s.nodes.get(pod.node)
        if node is not None and node.has_gpus:
            alert = True
            out.actions.append(
                PostEvent(
                    pod.ref,
                    "Warning",
                    "RendezvousOnGPUNode",
                    f"rendezvous pod {pod.name} runs on GPU node {pod.host_node}: a reclaim of that node takes the "
                    "job's etcd with it; pin it to CPU nodes",
                )
            )
    return alert


def flapping(s: JobSnapshot, now: float, settings: ControllerSettings, newest: PodInfo | None, out: Out) -> bool:
    """Whether too many rounds within the flapping window gave way before the trainers took
    a step in them (warned on ``newest``): the rendezvous re-forms again and again and the
    job gets nowhere (ranks that die before their first step, members that come and go
    while a round gathers). A round that trained does not count, whoever asked for it: the
    controller's re-forms, planned or not, in place or restarting the workers, with a spare
    or not, and the agents' own round around a crashed rank are churn the job got through."""
    window = settings.reform.flapping_window.total_seconds()
    recent = [t for t in s.untrained_round_times if now - window <= t <= now]
    if len(recent) < settings.reform.flapping_rounds:
        return False
    if newest is not None:
        out.actions.append(
            PostEvent(
                newest.ref,
                "Warning",
                "RendezvousFlapping",
                f"job {s.job}: {len(recent)} rendezvous rounds gave way before a training step in them "
                f"within {settings.reform.flapping_window}",
            )
        )
    # Requeue so the alert clears once the window has passed.
    out.again_in(min(recent) + window - now)
    return True
