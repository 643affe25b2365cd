"""What regroup's public API costs a user's script: PyTorch's FSDP2 example with and without it.

``python -m bench script [--quick] [--rounds N] [--steps N] [--warmup N] [--global-batch G]
[--also-synced-anchor] [--also-without-snapshots] [--max-others CORES] [--profile DIR]
[--json PATH]``

Two variants of the same training, at the demo's scale (4 ranks, one per node), alternated
in one run (without, with, without, with, ...):

- **without** (the anchor): ``bench/_script_anchor.py``, the upstream example's model,
  sharding, optimizer and clipping in a plain loop under ``torchrun --standalone
  --nproc-per-node=4`` (``init_process_group``, no etcd);
- **with** the API: ``examples/fsdp2/train.py`` (the same example converted to
  ``regroup.elastic``) under four ``regroup-run --standby --rdzv-backend=etcd-v3``
  agents posing as nodes ``n0..n3`` on a real etcd, so the step boundary's all-reduce, the
  in-memory snapshots the example asks for, the checkpoint-request check and progress
  publishing to etcd all run.

Both train the same global batch for the same steps with ``OMP_NUM_THREADS=1``. Rank 0 logs
one JSON line per step with its wall time and its process CPU (``time.process_time()``);
the first ``--warmup`` steps are dropped. Step time is the median gap between consecutive
steps (and the window's mean); CPU per step is rank 0's process CPU over the window divided
by its steps, and the same summed over the four worker processes, read from ``/proc`` by a
sampler thread (``utime + stime``, interpolated at the window's ends); rank 0's CPU off its
main thread and the agents' (plus etcd's) CPU are shown too. The table gives each variant's
median over rounds, the ratio with/without, and the spread: each variant's range over
rounds and the range of the per-round ratios (each round's pair ran back to back).

The machine's busy CPU (``/proc/stat``) less the benchmark's own processes says what other
processes took during each window (``others_cores``); ``--max-others`` runs a round again
(up to 3 times) when that is above a limit. Each run's first-step loss (mean over ranks) is
compared across runs: the variants must train the same thing.

``--also-synced-anchor`` adds a second anchor to each round: the plain loop that also
all-reduces its loss every step (one small collective per step, as the API's boundary).
``--also-without-snapshots`` adds the example with ``snapshot_every=0``. ``--profile DIR``
then runs one more round of the plain loop and the API under cProfile (rank 0's main
thread, CPU clock; ``bench/_profiled.py``, which also records every thread's CPU) and prints
regroup's own per-step functions and rank 0's CPU per thread.

``--compile-reform [--compile-backend B] [--compile-layers N]`` measures something else
instead: what an in-place re-form (a loss, then a grow) costs the same model under
``torch.compile`` against uncompiled, in recompiles and in the first step's time
(``bench/_compile_reform.py``).

The package: ``variants`` (what each variant runs), ``runs`` (one run of a variant),
``cpu`` (CPU from ``/proc``), ``logs`` (what rank 0 logs), ``summary`` (one run's numbers
and the variants compared), ``rounds`` (the variants alternated), ``profiling``
(``--profile``), ``report`` (what it prints) and ``cli`` (the command).
"""

from __future__ import annotations

from bench.script.cli import main
from bench.script.cpu import CpuSample, CpuSampler, cpu_between, interpolate, machine_cpu, proc_cpu
from bench.script.logs import (
    Stamp,
    _json_lines,
    anchor_stamps,
    api_stamps,
    first_loss,
    global_batch_of,
    same_training,
)
from bench.script.profiling import profile_round, profile_rows, thread_cpu
from bench.script.report import print_report, table
from bench.script.rounds import disturbed, measure
from bench.script.runs import (
    _check_complete,
    _kill_group,
    _wait_all,
    base_env,
    loadavg,
    run_with,
    run_without,
    script_args,
)
from bench.script.summary import METRICS, compare, summarize
from bench.script.variants import (
    ANCHOR,
    NO_SNAPSHOTS,
    NODES,
    PROFILED,
    REPO,
    SCRIPT,
    SYNCED,
    VARIANTS,
    WORLD,
    Settings,
    without_snapshots,
)

__all__ = [
    "ANCHOR", "METRICS", "NODES", "NO_SNAPSHOTS", "PROFILED", "REPO", "SCRIPT", "SYNCED", "VARIANTS", "WORLD",
    "CpuSample", "CpuSampler", "Settings", "Stamp",
    "_check_complete", "_json_lines", "_kill_group", "_wait_all",
    "anchor_stamps", "api_stamps", "base_env", "compare", "cpu_between", "disturbed", "first_loss",
    "global_batch_of", "interpolate", "loadavg", "machine_cpu", "main", "measure", "print_report", "proc_cpu",
    "profile_round", "profile_rows", "run_with", "run_without", "same_training", "script_args", "summarize",
    "table", "thread_cpu", "without_snapshots",
]  # fmt: skip
