"""``regroup status --job J``: a job's state as etcd holds it (no Kubernetes access needed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from regroup.controller.etcd_flags import add_etcd_arguments, etcd_settings
from regroup.controller.reform_summary import completion_event, reform_seconds
from regroup.controller.tracing import phase_times
from regroup.etcd import ClientError, EtcdSettings, EtcdUnavailable, connect
from regroup.keys import JobKeys
from regroup.records import (
    Exclusions,
    JobStatus,
    MemberRecord,
    Progress,
    RecordError,
    ReformOutcome,
    ReformPhase,
    ReformPlan,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job's regroup.dev/job label value")
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"), help="the job's namespace")
    # The controller's etcd flags (a production etcd wants its CA and a client certificate).
    add_etcd_arguments(parser, "etcd host:port[,host:port]")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


async def job_status(keys: JobKeys, etcd: EtcdSettings) -> dict[str, Any]:
    """Everything ``regroup status`` shows, as a JSON-able dict."""
    client = await connect(etcd)
    try:
        listing = await client.get_prefix(keys.root.encode())
    finally:
        await client.close()
    members: list[dict[str, Any]] = []
    report: dict[str, Any] = {"namespace": keys.namespace, "job": keys.job, "members": members}
    for kv in listing.kvs:
        rest = kv.key.decode()[len(keys.root):]
        try:
            if rest.startswith("members/"):
                m = MemberRecord.from_json(kv.value)
                members.append({"node": m.node, "pod": m.pod, "round": m.round, "local_world_size": m.local_world_size,
                                "restart_count": m.restart_count})
            elif rest == "progress":
                p = Progress.from_json(kv.value)
                report["progress"] = {"step": p.step, "world_size": p.world_size, "loss": p.loss, "time": p.time,
                                      "resumed_from_step": p.resumed_from_step}
            elif rest == "control/status":
                report["status"] = asdict(JobStatus.from_json(kv.value))
            elif rest == "control/excluded":
                report["excluded"] = dict(Exclusions.from_json(kv.value).nodes)
            elif rest == "control/plan":
                plan = ReformPlan.from_json(kv.value)
                done = plan.phase == ReformPhase.DONE
                completed = done and plan.outcome == ReformOutcome.COMPLETED
                event, summary = completion_event(plan) if completed else ("", "")
                report["last_reform"] = {
                    "generation": plan.generation, "cause": plan.cause.value, "planned": plan.planned,
                    "strategy": plan.strategy, "replaced": dict(plan.replaced),
                    "phase": plan.phase.value, "outcome": plan.outcome.value, "reason": plan.reason,
                    "fallback": plan.fallback, "why": plan.why,
                    "node_count_before": len(plan.nodes_before), "node_count_after": len(plan.nodes_after),
                    "lost_steps": plan.lost_steps, "trace_id": plan.trace_id,
                    "duration_s": round(reform_seconds(plan), 3) if done else None,
                    # The re-form's Event (Resized, NodeReplaced or NodeMigrated): etcd keeps only the
                    # last re-form; earlier ones are in the Events (kubectl get events --field-selector
                    # reason=Resized, and the same for the other two).
                    "event": event, "summary": summary,
                    "phases_s": {k: round(max(0.0, e - s), 3) for k, (s, e) in phase_times(plan).items()}
                    if done else {},
                }
        except RecordError as exc:
            report.setdefault("unreadable", []).append(f"{rest}: {exc}")
    members.sort(key=lambda m: m["node"])
    status = report.get("status") or {}
    report["state"] = status.get("state", "unknown (no controller verdict)")
    report["node_count"] = status.get("node_count", len(members))
    report["active_nodes"] = report["node_count"]
    report["spare_nodes"] = status.get("spare_count", 0)
    report["spares_wanted"] = status.get("spares_wanted", 0)
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"job {report['namespace']}/{report['job']}: {report['state']}"]
    status = report.get("status")
    if status:
        lines.append(f"  world: {status['node_count']} nodes (min {status['min_nodes']}, max {status['max_nodes']})"
                     f" - {status['reason']}")
        spares, wanted = status.get("spare_count", 0), status.get("spares_wanted", 0)
        if spares or wanted:
            names = f": {', '.join(status.get('spares', []))}" if spares else ""
            short = "  - below wanted: the next loss shrinks the job" if spares < wanted else ""
            lines.append(f"  spares: {spares} (wanted {wanted}){names}{short}")
        if status.get("warming"):
            lines.append(f"  warming up to join: {', '.join(status['warming'])} (their workers are starting)")
        if status.get("alerts"):
            lines.append(f"  alerts: {', '.join(status['alerts'])}")
    lines.append(f"  members ({len(report['members'])}):")
    for m in report["members"]:
        lines.append(f"    {m['node']:<24} pod {m['pod'] or '-':<32} round {m['round']:<4} ranks {m['local_world_size']}"
                     f"  restarts {m['restart_count']}")
    progress = report.get("progress")
    if progress:
        age = timedelta(seconds=int(max(0.0, time.time() - progress["time"])))
        lines.append(f"  last step: {progress['step']} on {progress['world_size']} ranks ({age} ago),"
                     f" resumed from step {progress['resumed_from_step']}")
    last = report.get("last_reform")
    if last:
        how = "planned" if last["planned"] else "unplanned"
        if last.get("strategy", "elastic") != "elastic":
            how += f", {last['strategy']}"
        head = (f"  last re-form: #{last['generation']} {last['cause']} "
                f"({how}) {last['node_count_before']} -> "
                f"{last['node_count_after']} nodes, {last['phase']}")
        if last["phase"] == ReformPhase.DONE:
            head += f", {last['outcome']} in {last['duration_s']}s, lost steps {last['lost_steps']}"
        lines.append(head)
        if last.get("summary"):
            lines.append(f"    {last['event']}: {last['summary']}")
        for phase, seconds in last["phases_s"].items():
            lines.append(f"    {phase:<11} {seconds:8.3f}s")
        if last["fallback"]:
            lines.append(f"    fell back to unplanned: {last['fallback']}")
        if last["outcome"] not in (ReformOutcome.PENDING, ReformOutcome.COMPLETED):
            lines.append(f"    abandoned: {last['why']}")
    for node, why in sorted(report.get("excluded", {}).items()):
        lines.append(f"  excluded: {node} ({why}): its agent waits instead of joining")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        keys = JobKeys(args.namespace, args.job)
        etcd = etcd_settings(args)
    except ValueError as exc:
        print(f"regroup status: {exc}")
        return 2
    try:
        report = asyncio.run(job_status(keys, etcd))
    except (EtcdUnavailable, ClientError) as exc:  # ClientError: a certificate etcd refuses this job's keys
        print(f"regroup status: {exc}")
        return 1
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        # The re-form line has an arrow: a terminal that cannot show it gets an escape, not a traceback.
        reconfigure = getattr(sys.stdout, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
        print(render(report))
    return 0
