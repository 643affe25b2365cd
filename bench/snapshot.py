"""In-memory snapshots: the loop's stall per step and the host memory they take.

``python -m bench snapshot [--quick] [--sizes-mb 100,1000] [--steps 8] [--rounds 3] [--json PATH]``

For each state size (the trainer's own model + AdamW state, as ``bench checkpoint``
builds it) it starts one ``torchrun`` job (2 ranks on gloo on a CPU machine; one rank per
GPU on CUDA) that runs the training loop's step in blocks of three modes, in turn, in the
same processes: without snapshots (the anchor), with a snapshot at every step, and with
``every: auto``. A snapshot is taken as the trainer takes it: the copy into host memory
runs in a background thread while the next step's forward and backward compute; the loop
waits for it only before the optimizer step, and for the exchange with the buddy rank
only when the next snapshot is due. It reports each mode's step time (the median over
blocks of each block's mean), the loop's wait per step, the interval ``auto`` settled on,
and host memory: the bytes the snapshots hold against the rank's state, and the growth of
the process's resident memory.

A world of one rank (one GPU) has no buddy: it measures the copy alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(state_mb: float, steps: int, rounds: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from bench.checkpoint import _model_for
    from regroup.elastic.world.boundary import agree
    from regroup.trainer.config_loading import config_from_dict
    from regroup.elastic.world.runtime import init_runtime
    from regroup.trainer.sharding import build_sharded_model
    from regroup.elastic.memory.snapshot import Snapshots
    from regroup.elastic.memory.snapshot_cost import state_bytes

    cfg = config_from_dict({"model": _model_for(state_mb)})
    rt = init_runtime(dict(os.environ), "auto", timeout=timedelta(minutes=10))
    model = build_sharded_model(cfg.model, 0, rt.mesh, rt.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # A CPU step on one batch of 4 x 64 tokens, as ``bench checkpoint`` times it; a GPU step
    # on 64 x 64 tokens, so the step is not over before the GPU has warmed up.
    samples = 64 if rt.is_cuda else 4
    tokens = torch.randint(cfg.model.vocab_size, (samples, 64), generator=torch.Generator().manual_seed(rt.rank))
    tokens = tokens.to(rt.device)
    place = ("", os.environ.get("NODE_NAME", f"node-{rt.rank}"))  # one node per rank, as a job spreads them
    # Auto as with a raised snapshot.max_every: the spacing the measured cost alone asks for.
    snaps = Snapshots(model, optimizer, rt.rank, rt.world_size, place, 1, timedelta(minutes=10), max_every=1000)

    def one_step(step: int, snapshots: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        model(tokens).float().logsumexp(-1).mean().backward()
        waited = 0.0
        if snapshots:
            w0 = time.perf_counter()
            snaps.wait_copied()
            waited += time.perf_counter() - w0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        w0 = time.perf_counter()
        done = snaps.done(step) if snapshots else True
        waited += time.perf_counter() - w0
        cost = snaps.observe(time.perf_counter() - t0)  # steps without snapshots are auto's baseline
        decided = agree(rt.control_group, rt.world_size, generation=0, stop=False, save_due=False, loss=0.0,
                        snapshot_done=done, snapshot_cost=cost if snapshots else 0.0)  # fmt: skip
        if snapshots:
            w0 = time.perf_counter()
            snaps.agreed(decided.snapshot_done, decided.snapshot_cost)
            if snaps.due(step):
                snaps.take(step)
            snaps.settled()
            waited += time.perf_counter() - w0
        if rt.is_cuda:
            # The step's own stream, as the loop's loss read does; the copy's stream runs on.
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0, waited

    results: dict[str, Any] = {"rank": rt.rank, "world": rt.world_size, "device": str(rt.device)}
    step = 1
    for _ in range(2):  # warm-up; AdamW's state exists after the first step
        one_step(step, snapshots=False)
        step += 1
    rss_before = _rss()
    started = time.perf_counter()
    while not snaps.ready:  # the buffers are allocated in the background, training on
        one_step(step, snapshots=True)
        step += 1
    ready_s = time.perf_counter() - started

    def flush() -> None:
        """Let the snapshot under way finish, so the next block starts without one."""
        snaps.done(10**9)
        snaps.agreed(True, 0.0)
        snaps.settled()

    # Blocks of each mode in turn, so a drift of the machine's speed hits all three alike.
    blocks: dict[str, list[float]] = {"plain": [], "every": [], "auto": []}
    waits: list[float] = []
    auto_every = 1
    for _ in range(rounds):
        for mode in blocks:
            flush()
            snaps.auto, snaps.every = mode == "auto", auto_every if mode == "auto" else 1
            timed = []
            for _ in range(steps):
                timed.append(one_step(step, snapshots=mode != "plain"))
                step += 1
            if mode == "auto":
                auto_every = snaps.every
            if mode == "every":
                waits += [w for _, w in timed]
            # A mean: in an auto block the steps a snapshot overlaps are the cost.
            blocks[mode].append(statistics.mean(t for t, _ in timed))
    flush()  # the last exchange, before the buffers are read
    plain = blocks["plain"]
    results.update(
        step_plain_s=statistics.median(plain),
        step_snapshot_s=statistics.median(blocks["every"]),
        wait_s=statistics.median(waits),
        wait_max_s=max(waits),
        auto_every=auto_every,
        step_auto_s=statistics.median(blocks["auto"]),
        ready_s=ready_s,
        state_bytes=state_bytes(model),
        snapshot_bytes=snaps.host_bytes,
        rss_growth_bytes=_rss() - rss_before,
        committed_step=None if snaps.committed is None else snaps.committed.step,
    )
    snaps.close()
    out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure(state_mb: float, steps: int, rounds: int, nproc: int, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{int(state_mb)}mb"
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "bench", "snapshot", "--worker", str(state_mb), "--steps", str(steps),
        "--rounds", str(rounds), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]
    worst = max(ranks, key=lambda r: r["wait_s"])
    return {
        "state_mb": round(ranks[0]["state_bytes"] / 1e6, 1),
        "job_state_mb": state_mb,
        "world": nproc,
        "device": ranks[0]["device"],
        "step_plain_s": round(statistics.median(r["step_plain_s"] for r in ranks), 4),
        "step_snapshot_s": round(statistics.median(r["step_snapshot_s"] for r in ranks), 4),
        "wait_s": round(worst["wait_s"], 5),
        "wait_share": round(worst["wait_s"] / worst["step_plain_s"], 4),
        "wait_max_s": round(max(r["wait_max_s"] for r in ranks), 4),
        "ready_s": round(max(r["ready_s"] for r in ranks), 3),
        "snapshot_bytes": ranks[0]["snapshot_bytes"],
        "snapshot_x_state": round(ranks[0]["snapshot_bytes"] / ranks[0]["state_bytes"], 2),
        "rss_growth_x_state": round(max(r["rss_growth_bytes"] for r in ranks) / ranks[0]["state_bytes"], 2),
        "committed_step": ranks[0]["committed_step"],
        "overhead": round(statistics.median(r["step_snapshot_s"] / r["step_plain_s"] - 1 for r in ranks), 4),
        "auto_every": max(r["auto_every"] for r in ranks),
        "auto_overhead": round(statistics.median(r["step_auto_s"] / r["step_plain_s"] - 1 for r in ranks), 4),
        "steps": steps,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench snapshot", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100 MB only, 4 steps (about a minute)")
    parser.add_argument("--sizes-mb", default="100,1000", help="comma-separated state sizes in MB (whole job)")
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks of each mode, in turn")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        from regroup.telemetry import configure_logging

        configure_logging("warning")
        worker(args.worker, args.steps, args.rounds, Path(args.out) / f"rank-{os.environ.get('RANK', '0')}.json")
        return 0
    import torch

    nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    sizes = [100.0] if args.quick else [float(s) for s in args.sizes_mb.split(",")]
    steps, rounds = (4, 2) if args.quick else (args.steps, args.rounds)
    with tempfile.TemporaryDirectory(prefix="regroup-bench-snapshot-") as scratch:
        rows = [measure(size, steps, rounds, nproc, Path(scratch)) for size in sizes]
    print(
        "| state: job (per rank) | ranks | step, no snapshots (anchor) | step, snapshot every step (overhead) "
        "| loop's wait per step (share of the step) | auto: every | auto: overhead "
        "| snapshot memory per rank | RSS growth per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['job_state_mb']:.0f} MB ({r['state_mb']:.0f} MB) | {r['world']} ({r['device']}) "
            f"| {r['step_plain_s']:.3f} s | {r['step_snapshot_s']:.3f} s ({r['overhead']:+.1%}) "
            f"| {r['wait_s'] * 1000:.1f} ms, max {r['wait_max_s'] * 1000:.0f} ms ({r['wait_share']:.2%}) "
            f"| {r['auto_every']} | {r['auto_overhead']:+.1%} "
            f"| {r['snapshot_x_state']:.1f}x state | {r['rss_growth_x_state']:.1f}x state |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0

