"""Trace and span ids of a re-form, derived from the plan so any leader can finish its trace.

The ids are fixed when the plan is made (the checkpoint request already carries the
checkpoint span's ``traceparent`` to the trainers), and the spans are exported when the
re-form finishes, possibly by another controller replica.
"""

from __future__ import annotations

import hashlib

from regroup.records import TRACED_PHASES

PHASES = TRACED_PHASES


def new_trace_id(namespace: str, job: str, generation: int, decided_at: float) -> str:
    """A 32-hex-digit trace id unique to one re-form of one job."""
    seed = f"{namespace}/{job}/{generation}/{decided_at:.6f}".encode()
    digest = hashlib.sha256(seed).hexdigest()[:32]
    return digest if int(digest, 16) else "1".rjust(32, "0")


def span_id(trace_id: str, name: str) -> str:
    """The 16-hex-digit id of the re-form's ``root`` span or of one of its ``PHASES``."""
    digest = hashlib.sha256(f"{trace_id}/{name}".encode()).hexdigest()[:16]
    return digest if int(digest, 16) else "1".rjust(16, "0")


def traceparent(trace_id: str, name: str) -> str:
    """W3C ``traceparent`` naming the span ``name`` of the trace (sampled)."""
    return f"00-{trace_id}-{span_id(trace_id, name)}-01"
