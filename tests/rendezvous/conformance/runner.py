"""Runs the conformance scenarios against each backend and tabulates the results.

A scenario (``Scenario``) is a function of a ``Run`` (``scenario_run``): one backend
(``backends``), one fresh ``--rdzv-id``, its own folder. ``run_all`` runs each scenario on
each backend it applies to, a few at a time; where a backend isolates its handlers
(etcd-v3, see ``EtcdV3``) the scenarios of handlers only run in a child process of their
own. ``table`` writes the results as a markdown table.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.rendezvous.conformance.backends import Backend, C10d, EtcdV3
from tests.rendezvous.conformance.processes import Launcher, read_log
from tests.rendezvous.conformance.scenario_run import Run


@dataclass(frozen=True)
class Scenario:
    """One behaviour torch's tests expect of a rendezvous backend."""

    key: str
    """Short id (also the ``--rdzv-id``)."""
    title: str
    source: str
    """The torch test it comes from: ``file::test``."""
    run: Callable[[Run], str | None]
    """Raises ``AssertionError`` when the backend does not behave; may return a note."""
    backends: tuple[str, ...] = ("etcd-v3", "c10d")
    cost: float = 1.0
    """Rough seconds it takes; the costly ones are started first."""
    in_process: bool = False
    """Only handlers in this process (no launcher): these run first, while the launcher
    imports torch."""


@dataclass
class Result:
    scenario: Scenario
    backend: str
    passed: bool
    seconds: float
    note: str = ""
    detail: str = ""


def run_one(scenario: Scenario, backend: Backend, root: Path, launcher: Launcher, env: dict[str, str]) -> Result:
    out = root / f"{scenario.key}-{backend.name}"
    out.mkdir(parents=True)
    run = Run(backend=backend, run_id=f"{scenario.key}-{backend.name}", out=out, launcher=launcher, env=env)
    if scenario.in_process and backend.isolate_handlers:
        return _run_apart(scenario, run)
    return _run_here(scenario, run)


def _run_here(scenario: Scenario, run: Run) -> Result:
    started = time.monotonic()
    try:
        note = scenario.run(run) or ""
        return Result(scenario, run.backend.name, True, time.monotonic() - started, note)
    except Exception as exc:  # noqa: BLE001 - every failure is a result to report
        first = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        detail = "".join(traceback.format_exception(exc))[-3000:] + "\n" + run.logs()
        return Result(scenario, run.backend.name, False, time.monotonic() - started, first, detail)
    finally:
        run.close()


APART_LIMIT_S = 60.0


def _run_apart(scenario: Scenario, run: Run) -> Result:
    """The scenario in a forked child of the launcher, which writes its ``Result`` as JSON."""
    started = time.monotonic()
    result = run.out / "result.json"
    request = {
        "kind": "call",
        "env": run.env,
        "log": str(run.out / "child.log"),
        "target": "tests.rendezvous.conformance.runner:run_in_child",
        "kwargs": {
            "key": scenario.key, "backend": run.backend.name, "endpoint": run.backend.endpoint(run),
            "out": str(run.out), "run_id": run.run_id, "result": str(result),
        },
    }  # fmt: skip
    try:
        child = run.children.spawn(request)
        code = run.children.exit_code(child, APART_LIMIT_S)
        if code is None:
            run.children.kill(child)
        if not result.exists():
            log = read_log(run.out / "child.log")[-3000:]
            return Result(scenario, run.backend.name, False, time.monotonic() - started, f"child exited {code}", log)
        data = json.loads(result.read_text())
        return Result(scenario, run.backend.name, data["passed"], data["seconds"], data["note"], data["detail"])
    finally:
        run.close()


def run_in_child(key: str, backend: str, endpoint: str, out: str, run_id: str, result: str) -> None:
    """``_run_apart``'s child: run scenario ``key`` here and write its result."""
    from tests.rendezvous.conformance.scenarios import SCENARIOS

    scenario = next(s for s in SCENARIOS if s.key == key)
    chosen = C10d() if backend == "c10d" else EtcdV3(endpoint)
    run = Run(backend=chosen, run_id=run_id, out=Path(out), launcher=None, env=dict(os.environ))
    outcome = _run_here(scenario, run)
    fields = {"passed": outcome.passed, "seconds": outcome.seconds, "note": outcome.note, "detail": outcome.detail}
    Path(result).write_text(json.dumps(fields))


def run_all(
    scenarios: list[Scenario],
    backends: list[Backend],
    root: Path,
    launcher: Launcher,
    env: dict[str, str],
    threads: int,
) -> list[Result]:
    # What needs no launcher first (it runs while the launcher imports torch), then the
    # costliest first.
    tasks = sorted(
        ((s, b) for s in scenarios for b in backends if b.name in s.backends),
        key=lambda task: (not (task[0].in_process and not task[1].isolate_handlers), -task[0].cost),
    )
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="conformance") as pool:
        futures = [pool.submit(run_one, s, b, root, launcher, env) for s, b in tasks]
        return [f.result() for f in futures]


def table(
    scenarios: list[Scenario], results: list[Result], not_applicable: dict[str, str], c10d_known: dict[str, str]
) -> str:
    """The results as a markdown table: scenario x backend, with the notes."""
    by = {(r.scenario.key, r.backend): r for r in results}
    lines = ["| scenario | torch test | etcd-v3 | c10d | note |", "|---|---|---|---|---|"]
    for s in scenarios:
        cells = []
        notes = []
        for backend in ("etcd-v3", "c10d"):
            r = by.get((s.key, backend))
            if r is None:
                cells.append("n/a")
                continue
            verdict = "pass" if r.passed else "differs" if s.key in not_applicable and backend == "etcd-v3" else "FAIL"
            cells.append(f"{verdict} ({r.seconds:.1f}s)")
            if r.note:
                notes.append(f"{backend}: {r.note}")
        if s.key in not_applicable:
            notes.insert(0, f"not applicable to etcd-v3: {not_applicable[s.key]}")
        control = by.get((s.key, "c10d"))
        if s.key in c10d_known and control is not None and not control.passed:
            notes = [n for n in notes if not n.startswith("c10d:")]
            notes.append(f"c10d, known torch bug: {c10d_known[s.key]} (here: {control.note[:160]})")
        lines.append(f"| {s.title} | `{s.source}` | {cells[0]} | {cells[1]} | {'; '.join(notes)} |")
    return "\n".join(lines)
