"""``regroup whatif``: the expected goodput of a job under a given churn, three ways (four
with ``--spares``); and with ``--params``, what moving a model of that size costs at each
kind of re-form.

Reads the job's own spans (``regroup trace-report``'s reading: the same re-forms, and in a
``regroup demo`` run folder the rank crashes the run recorded), asks the model
(``regroup.whatif.model``) and prints its tables, or JSON with ``--json``
(``regroup.whatif.report``). Bad input (a malformed duration, an empty spans file, spans
without a re-form) exits 2 with a message that names the option or the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from regroup.controller.jobconfig import parse_duration
from regroup.trace_report import SpansFileError, load_spans, run_records
from regroup.whatif.churn import DEFAULT_NOTICE, DEFAULT_REPLACE_AFTER, Churn, JobShape, WhatIfError
from regroup.whatif.costs import costs_from_stalls
from regroup.whatif.model import outcomes
from regroup.whatif.recorded import Stall, recorded_checkpoint, stalls_from_spans, step_seconds
from regroup.whatif.report import as_json, format_report
from regroup.whatif.sizes import Hardware, Projection, SizedJob, format_projection, parse_count, project


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


DESCRIPTION = (
    "expected goodput under a churn rate of three strategies (in-place elastic, restart elastic, fixed size with "
    "checkpoint-restart), and a fourth with --spares (fixed size + spares); the min/max and checkpoint interval "
    "that maximise it"
)
"""What ``regroup whatif --help`` says it does: the strategies it prints (``model.outcomes``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("spans", type=Path, nargs="?",
                        help="the job's OTLP JSON-lines spans file, or a `regroup demo` run folder "
                             "(optional with --params)")  # fmt: skip
    parser.add_argument("--nodes", type=int, required=True, help="the job's full size (an elastic job's max)")
    parser.add_argument("--spares", type=int, default=0,
                        help="idle nodes a fixed-size job keeps to replace a lost one; given, the fixed size + spares "
                             "strategy is priced too (default 0)")  # fmt: skip
    parser.add_argument("--min-nodes", type=int, help="the elastic job's min (default: the recommended one)")
    churn = parser.add_argument_group("churn (mean time between events, for the whole job: 20m, 2h, 1h30m)")
    churn.add_argument("--reclaim-every", type=_duration, help="reclaim notices (spot reclaims, drains)")
    churn.add_argument("--loss-every", type=_duration, help="abrupt node losses")
    churn.add_argument("--flaky-every", type=_duration, help="nodes going bad (crashing their rank until cordoned)")
    churn.add_argument("--joins-every", type=_duration,
                       help="grows (default: each node that leaves is replaced, one grow each)")  # fmt: skip
    churn.add_argument("--notice", type=_duration, default=DEFAULT_NOTICE, help="a reclaim's notice (default 2m)")
    churn.add_argument("--replace-after", type=_duration, default=DEFAULT_REPLACE_AFTER,
                       help="from a node leaving to its replacement joining (default 5m)")  # fmt: skip
    churn.add_argument("--restart-storm", type=int, default=Churn().restart_storm,
                       help="K of the job's restart-storm rule: a flaky node's crashes before its cordon "
                            "(default 3)")  # fmt: skip
    given = parser.add_argument_group("what the spans may not record")
    given.add_argument("--checkpoint-cost", type=_duration,
                       help="one checkpoint save to storage (default: recorded: the trainers' saves to storage in the "
                            "spans, else their checkpoints acked from memory, said so)")  # fmt: skip
    given.add_argument("--step-time", type=_duration, help="one training step (default: recorded)")
    given.add_argument("--process-start", type=_duration,
                       help="a restarted worker's start (default: recorded on the restart path, else 60s)")  # fmt: skip
    given.add_argument("--checkpoint-every", type=_duration,
                       help="pin the checkpoint interval (default: Young's optimum)")  # fmt: skip
    sized = parser.add_argument_group("the model's size (--params): what moving its state costs, on paper")
    sized.add_argument("--params", help="parameters of the model: 7B, 70B, 350M")
    sized.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8)")
    sized.add_argument("--tokens-per-step", default="4M", help="tokens of one global batch (default 4M)")
    sized.add_argument("--mfu", type=float, default=0.40, help="model FLOPs utilisation of a step (default 0.40)")
    sized.add_argument("--fabric-gbps", type=float, default=Hardware.fabric_gbps,
                       help="GB/s of network per GPU (default 50: 400 Gb/s)")  # fmt: skip
    sized.add_argument("--host-copy-gbps", type=float, default=Hardware.host_copy_gbps,
                       help="GB/s of a GPU's copies to host memory (default 50: PCIe gen5 x16)")  # fmt: skip
    sized.add_argument("--storage-gbps", type=float, default=Hardware.storage_gbps,
                       help="GB/s of a node's checkpoint writes (default 10: local NVMe)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _stalls(path: Path) -> tuple[list[dict[str, Any]], list[Stall]]:
    try:
        spans = load_spans(path)
    except SpansFileError as exc:
        raise WhatIfError(str(exc)) from None
    shown = path / "spans.jsonl" if path.is_dir() else path
    if not spans:
        raise WhatIfError(f"{shown}: no spans in it")
    records = run_records(path)  # a `regroup demo` run's: its worlds re-formed after a crash start at the crash
    stalls = stalls_from_spans(spans, records.faults if records is not None else ())
    if not stalls:
        raise WhatIfError(f"{shown}: no re-form in it (no regroup.reform or regroup.trainer.resume span)")
    return spans, stalls


def _sized(args: argparse.Namespace) -> tuple[SizedJob, Hardware, Projection] | None:
    if args.params is None:
        return None
    job = SizedJob(
        parse_count(args.params, "--params"), args.nodes, args.gpus_per_node,
        tokens_per_step=parse_count(args.tokens_per_step, "--tokens-per-step"), mfu=args.mfu,
    )  # fmt: skip
    hw = Hardware(args.host_copy_gbps, args.fabric_gbps, args.storage_gbps)
    return job, hw, project(job, hw)


def run(args: argparse.Namespace) -> int:
    try:
        sized = _sized(args)
        if args.spans is None:
            if sized is None:
                raise WhatIfError("SPANS: the job's spans file, or --params to ask about a model's size alone")
            job, hw, projection = sized
            print(json.dumps(asdict(projection), indent=2) if args.json else format_projection(job, hw, projection))
            return 0
        churn = Churn(
            reclaim_every=args.reclaim_every, loss_every=args.loss_every, flaky_every=args.flaky_every,
            joins_every=args.joins_every, notice=args.notice, replace_after=args.replace_after,
            restart_storm=args.restart_storm,
        )  # fmt: skip
        job = JobShape(args.nodes, args.spares, args.min_nodes, args.checkpoint_every)
        spans, stalls = _stalls(args.spans)
        saved = recorded_checkpoint(spans)
        costs = costs_from_stalls(
            stalls, step=step_seconds(spans, stalls), checkpoint=None if saved is None else saved.seconds,
            step_option=args.step_time, checkpoint_option=args.checkpoint_cost, process_start_option=args.process_start,
            checkpoint_source="recorded" if saved is None else saved.source,
        )  # fmt: skip
    except WhatIfError as exc:
        print(f"regroup whatif: {exc}", file=sys.stderr)
        return 2
    found = outcomes(costs, churn, job)
    if args.json:
        body = as_json(args.spans, churn, job, stalls, costs, found)
        if sized is not None:
            body["sizes"] = asdict(sized[2])
        print(json.dumps(body, indent=2))
    else:
        print(format_report(churn, job, stalls, costs, found))
        if sized is not None:
            print("\n" + format_projection(*sized))
    return 0
