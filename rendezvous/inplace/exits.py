"""A worker that exited while its world was being re-formed in place, said in one line.

Under ``@elastic.in_place`` a re-form never ends the worker: it ends the call of the
training function with ``Reform`` (a ``BaseException``), and ``in_place`` forms the next
world in the same process. A worker that exits non-zero while its world is being re-formed,
without having told its agent why (``regroup.failures``: ``in_place`` records every error it
lets end the process), most likely had the re-form taken from it on the way: a wrapper or an
``except`` of the script that caught it and exited (``except BaseException``,
``os._exit``), or a script without ``in_place``. Its agent restarts it, as any failed worker,
and says so: in its log, and in its member record (``MemberRecord.worker_exit``), from which
the controller tells it in the re-form's Event and trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from regroup.failures import recorded
from regroup.rendezvous.inplace.channel import REFORMING, NodeWorld, WorkerReport

REFORM_EXIT = "the worker exited during an in-place re-form"
"""The agent's log event, and the start of the line it records."""

LIKELY_CAUSE = (
    "a wrapper or `except` in the script likely caught the re-form; "
    "put @elastic.in_place outermost or let regroup.elastic.Reform through"
)


def during_reform(world: NodeWorld | None, report: WorkerReport | None) -> bool:
    """Whether a worker whose last report is ``report`` (its own, None if it never wrote
    one) was in a re-form of its world when it exited, given the agent's ``world``: it said
    its world was ending for one, had left it, or was waiting for the next; or the agent had
    announced one, or handed out a world newer than the worker's."""
    if report is None:
        return False  # it never reached a world
    if report.state in (REFORMING, "leaving"):
        return True
    if report.state == "waiting":
        return report.round > 0  # round 0: waiting for its first world, not for a next one
    return world is not None and (world.pending or world.round > report.round)


def reform_exit(world: NodeWorld | None, report: WorkerReport | None, exitcode: int, recorded: bool) -> str:
    """The line that says why a worker that exited with ``exitcode`` likely did, or "" when
    nothing is to be said: it was not in a re-form, was killed by a signal (``exitcode``
    negative, as torch reports one), or told its agent why (``recorded``: an error it
    recorded, or a re-form it could not complete: its own log says which)."""
    if exitcode <= 0 or recorded or not during_reform(world, report):
        return ""
    return f"{REFORM_EXIT} (exit {exitcode}): {LIKELY_CAUSE}"


@dataclass(frozen=True)
class ReformExit:
    """A worker's exit during an in-place re-form, as its agent tells it."""

    note: str
    """The line (``reform_exit``)."""
    round: int
    """The round of the world the worker was in, or leaving."""
    last_state: str
    """The worker's last report (``WorkerReport.state``)."""
    announced: bool
    """The agent had announced the re-form (``world.json`` pending)."""


def read_reform_exit(channel: Path, failures: str, local_rank: int, pid: int, exitcode: int) -> ReformExit | None:
    """What the files say of worker ``local_rank`` (process ``pid``), which exited with
    ``exitcode``: the agent's ``world.json`` and the worker's report in ``channel``, and
    whether it recorded why in ``failures`` (``regroup.failures``; "": no such folder).
    None when it did not exit during a re-form, or nothing is to be said."""
    world = NodeWorld.read(channel)
    report = WorkerReport.read(channel, local_rank)
    if report is not None and report.pid != pid:
        report = None  # an earlier worker's file: this one never reported
    note = reform_exit(world, report, exitcode, bool(failures) and recorded(failures, local_rank))
    if not note:
        return None
    return ReformExit(
        note=note,
        round=report.round if report is not None else 0,
        last_state=report.state if report is not None else "no report",
        announced=bool(world and world.pending),
    )
