"""The exit codes of ``regroup-run`` that mean something to a workload (``docs/deploy.md``).

Kubernetes reads a container's exit code: 0 marks a pod of an Indexed Job, a JobSet or a
PyTorchJob *succeeded* (its index is done and never comes back), and under
``restartPolicy: Always`` any exit is a container restart. So a node that leaves a job that
goes on never exits 0.
"""

from __future__ import annotations

import contextlib
import os
import sys

FINISHED = 0
"""The job is over (its rendezvous is closed): every node exits 0."""

LEFT_JOB = 75
"""This node left a job that goes on: it was asked to stop (SIGTERM) and handed its state
over, or it stayed excluded from the job past ``excluded_timeout``. ``EX_TEMPFAIL`` of
``sysexits.h``: "try again later". Not a failure: the controller's restart-storm rule does
not count it, and a Job's ``podFailurePolicy`` can ``Ignore`` it so the index comes back."""

NOT_FAILURES = frozenset({FINISHED, LEFT_JOB})
"""Exit codes that never count as a crash of the node."""


def hard_exit(code: int) -> None:
    """Exit now, without joining background threads (an unfinished save must not block) and
    without unwinding (a signal in the middle of an import must not print a traceback)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
