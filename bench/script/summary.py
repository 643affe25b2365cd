"""``bench script``'s numbers: one run's per-step time and CPU after its warm-up, and the
variants compared over rounds (medians, ratios and their spread)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.script.cpu import CpuSample, cpu_between
from bench.script.logs import Stamp

# What the table shows, in its order: key, label, unit scale and unit.
METRICS: tuple[tuple[str, str], ...] = (
    ("step_s", "step time (median step)"),
    ("step_s_mean", "step time (window / steps)"),
    ("cpu_s", "CPU per step, rank 0 (process)"),
    ("cpu_all_s", "CPU per step, all 4 ranks (/proc)"),
    ("cpu_background_s", "CPU per step, rank 0 off its main thread"),
    ("cpu_agents_s", "CPU per step, agents (+ etcd)"),
)


def summarize(
    stamps: Sequence[Stamp], warmup: int, samples: Sequence[CpuSample] = (), rank0: int | None = None
) -> dict[str, Any]:
    """Per-step numbers of one run after dropping ``warmup`` steps: ``step_s`` (median gap
    between consecutive steps), ``step_s_mean`` (the window over its steps), ``cpu_s``
    (rank 0's process CPU over the window, per step) and ``cpu_s_median`` (median of its
    per-step CPU); with CPU samples also ``cpu_all_s`` (the workers together),
    ``cpu_agents_s``, and with rank 0's pid ``cpu_background_s`` (rank 0 off its main thread)."""
    window = list(stamps[warmup:])
    if len(window) < 3:
        raise ValueError(f"{len(stamps)} steps logged: too few after {warmup} warm-up steps")
    steps = len(window) - 1
    gaps = [b.t - a.t for a, b in zip(window, window[1:], strict=False)]
    cpus = [b.cpu_s - a.cpu_s for a, b in zip(window, window[1:], strict=False)]
    t0, t1 = window[0].t, window[-1].t
    row: dict[str, Any] = {
        "steps": steps,
        "first_step": window[0].step,
        "step_s": statistics.median(gaps),
        "step_s_mean": (t1 - t0) / steps,
        "cpu_s": (window[-1].cpu_s - window[0].cpu_s) / steps,
        "cpu_s_median": statistics.median(cpus),
    }
    if samples:
        spent = cpu_between(samples, t0, t1)
        row["cpu_all_s"] = spent["all"] / steps
        row["cpu_agents_s"] = spent["agents"] / steps
        # Cores other processes kept busy during the window (this benchmark's own sampler included).
        row["others_cores"] = (spent["machine"] - spent["all"] - spent["agents"]) / (t1 - t0)
        row["steal_cores"] = spent["steal"] / (t1 - t0)
        if rank0 is not None and str(rank0) in spent:
            row["cpu_rank0_proc_s"] = spent[str(rank0)] / steps
            row["cpu_background_s"] = (spent[str(rank0)] - spent[f"main:{rank0}"]) / steps
    return row


def compare(
    rounds: Sequence[Mapping[str, Mapping[str, float]]], variant: str = "with", base: str = "without"
) -> dict[str, dict[str, Any]]:
    """For each metric both variants have in every round: each variant's median over rounds
    and range, the ratio of the medians (``variant`` / ``base``) and the range of per-round
    ratios."""
    out: dict[str, dict[str, Any]] = {}
    if not rounds:
        return out
    pair = (base, variant)
    for key, _ in METRICS:
        if not all(key in r[v] for r in rounds for v in pair):
            continue
        values = {v: [float(r[v][key]) for r in rounds] for v in pair}
        medians = {v: statistics.median(values[v]) for v in pair}
        paired = [w / a for a, w in zip(values[base], values[variant], strict=True) if a > 0]
        out[key] = {
            "without": medians[base],
            "with": medians[variant],
            "without_range": [min(values[base]), max(values[base])],
            "with_range": [min(values[variant]), max(values[variant])],
            "delta": medians[variant] - medians[base],
            "ratio": medians[variant] / medians[base] if medians[base] > 0 else None,
            "ratio_range": [min(paired), max(paired)] if paired else None,
        }
    return out
