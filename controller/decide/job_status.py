"""``control/status``: the controller's verdict on the job, written only when it changes (its
node list alone, at most once a second)."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from datetime import timedelta

from regroup.controller.decide.cleanup import vacant_since
from regroup.controller.decide.out import Out
from regroup.controller.jobconfig import JobConfig
from regroup.controller.snapshot import JobSnapshot, WriteStatus
from regroup.records import JobStatus

NODES_EVERY = timedelta(seconds=1)
"""How often at most the status is rewritten when nothing but its nodes changed."""


def write_status(
    s: JobSnapshot,
    out: Out,
    state: str,
    reason: str,
    nodes: AbstractSet[str],
    config: JobConfig | None,
    now: float,
    flapping: bool = False,
    gpu: bool = False,
    spares: Sequence[str] = (),
    warming: Sequence[str] = (),
) -> None:
    """Ask for a ``control/status`` write when anything but the reason differs from the
    stored one; when only its nodes (or which nodes are spares) differ, at most once every
    ``NODES_EVERY``. ``spares``: the job's spare nodes (a running job's only), oldest first;
    ``warming``: the members warming up to join (``health.warming_joiners``)."""
    alerts = [name for name, on in (("rendezvous-flapping", flapping), ("rendezvous-on-gpu-node", gpu)) if on]
    min_nodes, max_nodes = (config.min_nodes, config.max_nodes) if config else (0, 0)
    wanted = config.spare_nodes if config is not None and state != "finished" else 0
    old = s.status
    since = old.since if old is not None and old.state == state and old.since else now
    vacant = vacant_since(s, now)
    # The reason alone changing (counts, phases) is not worth a write per decision.
    if old is not None and (
        old.state, old.min_nodes, old.max_nodes, old.alerts, old.since, old.vacant_since, old.spare_count,
        old.spares_wanted,
    ) == (state, min_nodes, max_nodes, alerts, since, vacant, len(spares), wanted):
        # The stored nodes are sorted; equal sizes and containment compare them without
        # sorting (a decision in a storm is cheaper by that sort).
        same_nodes = len(old.nodes) == len(nodes) and all(map(nodes.__contains__, old.nodes))
        if same_nodes and old.spares == list(spares) and old.warming == list(warming):
            return
        # Nodes flapping under a storm would rewrite the record with nearly every decision:
        # the last of them is written once the interval has passed.
        wait = old.updated_at + NODES_EVERY.total_seconds() - now
        if wait > 0:
            out.again_in(wait)
            return
    status = JobStatus(
        state=state,
        reason=reason,
        node_count=len(nodes),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nodes=sorted(nodes),
        alerts=alerts,
        updated_at=now,
        since=since,
        vacant_since=vacant,
        spare_count=len(spares),
        spares=list(spares),
        spares_wanted=wanted,
        warming=list(warming),
    )
    out.actions.append(WriteStatus(status))
