"""A demo whose job finished before its scenario: why the run stops, in words a user acts on.

A job that finished (its agents exit 0, the cluster's pods are replaced and exit 0 again)
never trains again, so nothing the run waits for (a settle, a scenario's event) can come:
``job_over``, one of the run's vital tasks, ends it at once with ``JobFinished``, which says
at which step the job finished, which of the scenario's events it did not reach and, for a
user's script, what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from regroup.demo.run_state import RunState


class JobFinished(RuntimeError):
    """The job finished (its agents exited 0) before the run's end: the rest of the scenario
    cannot play, and the run stops at once instead of waiting for training that never comes."""


def _listed(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def finished_early(run: RunState, script: bool) -> str:
    """Why the run stops when the job finished before its end: the step it finished at, the
    scenario's events it did not reach, and (for a user's script) what to change."""
    view = run.recorder.view if run.recorder else None
    step = view.progress.step if view is not None and view.progress is not None else None
    who = "your script" if script else "the job"
    said = f"{who} finished (its ranks exited 0) " + (
        "without publishing a training step" if step is None else f"at step {step}"
    )
    duration = run.scenario.duration.total_seconds()
    left = run.scenario.events[run.played :]
    if left:
        times = _listed([f"{e.at.total_seconds():.0f}s ({e.action})" for e in left])
        said += f", before the scenario's event{'s' if len(left) > 1 else ''} at {times}"
    else:
        said += f", before the scenario's end at {duration:.0f}s"
    if not script:
        return said
    advice = (
        f"train longer (more steps or epochs, in its arguments after --): "
        f"the scenario plays for {duration:.0f}s once the job trains settled"
    )
    if step is None:
        advice = f"publish progress through regroup.elastic (docs/demo.md, 'Your own script') and {advice}"
    return f"{said}: {advice}"


async def job_over(run: RunState, script: bool) -> None:
    """A vital task: ends with ``JobFinished`` once the job finished (an agent exited 0)."""
    await run.job_over.wait()
    raise JobFinished(finished_early(run, script))
