"""``bench script --profile``: one more round of the plain loop and the API under cProfile,
read back as rank 0's per-step functions and its CPU per thread."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.script.cpu import interpolate
from bench.script.logs import api_stamps
from bench.script.runs import run_with, run_without
from bench.script.summary import summarize
from bench.script.variants import NODES, PROFILED, REPO, VARIANTS, Settings

REGROUP_DIRS = tuple(str(REPO / d) for d in ("trainer", "rendezvous", "regroup"))
# The loop's own parts, in both variants: (end of the file's path, function name).
LANDMARKS = (
    ("torch/nn/modules/module.py", "_wrapped_call_impl"),
    ("torch/_tensor.py", "backward"),
    ("torch/nn/utils/clip_grad.py", "clip_grad_norm_"),
    ("torch/optim/adam.py", "step"),
    ("torch/_tensor.py", "__float__"),
)


def profile_rows(path: Path, steps: int, top: int = 25) -> list[tuple[str, float, float, int]]:
    """One cProfile file: (name, cumulative ms/step, own ms/step, calls/step) of the whole
    main thread (start and end included), of the loop's landmarks (forward, backward,
    clipping, Adam) and of regroup's own functions called at least once a step, by
    cumulative time."""
    import pstats

    stats = pstats.Stats(str(path))
    entries = stats.stats  # type: ignore[attr-defined]
    total = max(ct for (_, _, _), (_, _, _, ct, _) in entries.items())
    rows = [("(main thread, whole run)", total * 1e3 / steps, 0.0, 0)]
    mine = []
    for (file, line, name), (_, calls, tt, ct, _) in entries.items():
        row = (name, ct * 1e3 / steps, tt * 1e3 / steps, round(calls / steps))
        if any(file.endswith(suffix) and name == wanted for suffix, wanted in LANDMARKS):
            rows.append((f"{Path(file).name}:{line} {name}", *row[1:]))
        elif calls >= steps and str(Path(file).resolve()).startswith(REGROUP_DIRS):
            mine.append((f"{Path(file).resolve().relative_to(REPO)}:{line} {name}", *row[1:]))
    mine.sort(key=lambda r: -r[1])
    return rows + mine[:top]


def thread_cpu(samples: Sequence[Mapping[str, Any]], t0: float, t1: float) -> dict[str, float]:
    """CPU seconds each thread spent between ``t0`` and ``t1``, summed by thread name (threads
    Python does not know are ``native``), from ``bench/_profiled.py``'s ``.threads.json``."""
    tids = {tid for s in samples for tid in s["threads"]}
    out: dict[str, float] = {}
    for tid in tids:
        points, last, name = [], 0.0, "native"
        for s in samples:
            if tid in s["threads"]:
                name, last = s["threads"][tid][0], float(s["threads"][tid][1])
            points.append((float(s["t"]), last))
        # Numbered threads of one kind (a pool's workers, "Thread-7 (run)") count together.
        kind = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        kind = kind.split(" ", 1)[1] if kind.startswith("Thread-") and " " in kind else kind
        out[kind] = out.get(kind, 0.0) + interpolate(points, t1) - interpolate(points, t0)
    return out


def profile_round(settings: Settings, root: Path, endpoint: str, etcd_pid: int | None, clock: str) -> dict[str, Any]:
    out = root / "profiles"
    out.mkdir(exist_ok=True)
    result: dict[str, Any] = {}
    for variant in VARIANTS:
        folder = out / variant
        folder.mkdir()
        wrap = [str(PROFILED), str(folder)]
        env = {"REGROUP_BENCH_PROFILE_CLOCK": clock}  # read by bench/_profiled.py in the workers
        if variant == "without":
            run = run_without(settings, root, wrap=wrap, extra_env=env)
            rank0_label = "rank0"
        else:
            run = run_with(settings, root, endpoint, "script-profile", etcd_pid, wrap=wrap, extra_env=env)
            rank0_label = next(
                (n for n in NODES if api_stamps((root / f"script-profile-{n}.log").read_text(errors="replace"))), "n0"
            )
        files = sorted(folder.glob(f"{rank0_label}-*.prof"))
        if not files:
            raise RuntimeError(f"no profile of rank 0 in {folder}")
        summary = summarize(run["stamps"], settings.warmup)
        window = run["stamps"][settings.warmup :]
        threads_file = files[0].with_suffix(".threads.json")
        threads = json.loads(threads_file.read_text()) if threads_file.exists() else []
        per_thread = thread_cpu(threads, window[0].t, window[-1].t) if threads else {}
        result[variant] = {
            "file": str(files[0]),
            "rows": profile_rows(files[0], settings.steps),
            "summary": summary,
            "threads_cpu_per_step": {
                k: v / summary["steps"] for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1])
            },
        }
    return result
