"""The join-window scenario: a round of N agents, a quarter of which arrive while it gathers.

The round runs with ``--nnodes 3N/4:N``. 3N/4 agents call ``next_rendezvous`` together at
0 s, which opens the round's join window (its last call) once they have joined; the other
N/4 arrive one by one, evenly spread over ``[window, 2 window]``. The last call is
``3 window``, so the round completes when the last of them joins (max N). Measured, per
agent: from the moment the last agent called ``next_rendezvous`` until that agent returned
from it (rank, world size and the round's ``MASTER_ADDR`` known), as p50/p99/max over all N.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from bench._stats import percentile
from bench.rendezvous.fleet import Fleet


@dataclass
class WindowResult:
    backend: str
    n: int
    window: float
    p50: float | None = None
    p99: float | None = None
    max: float | None = None
    note: str = ""


def measure_window(
    backend: str, n: int, endpoints: dict[str, str], window: float, limit: float, fast: bool = False
) -> WindowResult:
    """Run the scenario once for ``backend`` with ``n`` agents; ``limit`` bounds the wait
    after the last arrival (the torch anchors' agents also give up then)."""
    early = n * 3 // 4
    late = n - early
    run_id = f"window-{backend.replace('-', '')}{n}-{int(time.time() * 1000) % 100000}"
    conf = {"last_call_timeout": f"{3 * window:g}", "join_timeout": f"{2 * window + limit:.0f}"}
    fleet = Fleet(backend, n, run_id, endpoints, (early, n), fast, conf)
    called = [0.0] * n
    returned = [0.0] * n
    sizes: set[int] = set()
    lock = threading.Lock()

    def agent(i: int) -> None:
        called[i] = time.monotonic()
        info = fleet.handlers[i].next_rendezvous()
        returned[i] = time.monotonic()
        with lock:
            sizes.add(info.world_size)

    result = WindowResult(backend, n, window)
    try:
        started = time.monotonic()
        futures = [fleet.pool.submit(agent, i) for i in range(early)]
        for k in range(late):
            time.sleep(max(0.0, started + window * (1 + k / max(1, late - 1)) - time.monotonic()))
            futures.append(fleet.pool.submit(agent, early + k))
        deadline = time.monotonic() + limit
        errors: list[str] = []
        for future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a timeout or the backend's error: counted, not raised
                errors.append(f"{type(exc).__name__}: {exc}"[:160])
        if errors:
            # A future still running at the deadline raises TimeoutError; anything else is the backend's error.
            failures = [e for e in errors if not e.startswith("TimeoutError")]
            result.note = f"> {limit:.0f}s ({len(errors)} of {n} not done)"
            if failures:
                result.note += f"; {len(failures)} failed, first: {failures[0]}"
            return result
        last = max(called)
        waits = sorted(r - last for r in returned)
        result.p50, result.p99, result.max = percentile(waits, 0.5), percentile(waits, 0.99), waits[-1]
        notes = []
        if sizes != {n}:
            notes.append(f"world sizes {sorted(sizes)}")
        if waits[0] < 0:
            notes.append(f"{sum(1 for w in waits if w < 0)} returned before the last arrival")
        result.note = "; ".join(notes)
        return result
    finally:
        fleet.close()


def window_table(results: list[WindowResult]) -> str:
    """Markdown rows: one per (N, backend), with the ratio of the anchors' p99 to ours."""
    ours = {r.n: r for r in results if r.backend == "etcd-v3"}
    lines = [
        "| scenario | N | backend | p50 | p99 | max | p99 / etcd-v3 p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r.n, r.backend != "etcd-v3", r.backend)):
        mine = ours.get(r.n)
        if r.p99 is None:
            cells, ratio = [r.note, "—", "—"], "—"
        else:
            cells = [f"{r.p50:.3f} s", f"{r.p99:.3f} s", f"{r.max:.3f} s"]
            ratio = f"{r.p99 / mine.p99:.1f}×" if mine and mine.p99 and r is not mine else "—"
            if r.note:
                cells[2] += f" ({r.note})"
        lines.append(f"| join window ({r.window:g} s) | {r.n} | {r.backend} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)
