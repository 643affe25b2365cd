"""``control/status``: the controller's verdict on the job, written only when it changes."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from controller.decide.out import Out
from controller.jobconfig import JobConfig
from controller.snapshot import JobSnapshot, WriteStatus
from regroup.records import JobStatus


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
) -> None:
    """Ask for a ``control/status`` write when anything but the reason differs from the stored one."""
    alerts = [name for name, on in (("rendezvous-flapping", flapping), ("rendezvous-on-gpu-node", gpu)) if on]
    min_nodes, max_nodes = (config.min_nodes, config.max_nodes) if config else (0, 0)
    old = s.status
    # The reason alone changing (counts, phases) is not worth a write per decision. The
    # stored nodes are sorted; equal sizes and containment compare them without sorting
    # (a decision in a storm is cheaper by that sort).
    if (
        old is None
        or (old.state, old.node_count, old.min_nodes, old.max_nodes, old.alerts)
        != (state, len(nodes), min_nodes, max_nodes, alerts)
        or len(old.nodes) != len(nodes)
        or not all(map(nodes.__contains__, old.nodes))
    ):
        status = JobStatus(
            state=state,
            reason=reason,
            node_count=len(nodes),
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nodes=sorted(nodes),
            alerts=alerts,
            updated_at=now,
        )
        out.actions.append(WriteStatus(status))
