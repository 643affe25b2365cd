"""Training stall per checkpoint: async (stage, then write in a thread) vs sync DCP save.

``python -m bench checkpoint [--quick] [--sizes-mb 100,1000] [--repeats N] [--json PATH]``

For each state size it builds the trainer's own model + AdamW state (parameters and two
moments: state bytes = 12 x parameters), then times, through the trainer's
``Checkpointer``, the sync save (the anchor: the loop is blocked for all of it) and the
async save's stall: the call (taking the state's references and queuing the save on the
checkpointer's writer thread) plus the wait for the copy to host memory, once waited at
once and once with one forward/backward of the model overlapping the copy, as in the
training loop (which waits only before the optimizer step). The copy and the write run
in background threads; what they take from the overlapped forward/backward shows as its
time next to the same forward/backward with no save running. All in one process on one
disk: the ratios matter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _model_for(state_mb: float) -> dict[str, int]:
    """A decoder config whose model + AdamW state is about ``state_mb`` megabytes."""
    target_params = state_mb * 1e6 / 12
    dim = 512 if state_mb < 400 else 1024
    per_layer = 4 * dim * dim + 3 * dim * (-(-int(8 * dim / 3) // 64) * 64) + 2 * dim
    layers = max(1, round((target_params - 2 * 256 * dim) / per_layer))
    return {"vocab_size": 256, "dim": dim, "n_layers": layers, "n_heads": 8, "seq_len": 64}


def measure(state_mb: float, repeats: int, root: Path) -> dict[str, Any]:
    import torch

    from regroup.elastic.checkpoint.app_state import AppState, TrainerState
    from regroup.elastic.checkpoint.checkpointer import Checkpointer
    from regroup.elastic.checkpoint.folders import folder_bytes, step_dir
    from regroup.elastic.world.runtime import init_runtime
    from regroup.trainer.config_loading import config_from_dict
    from regroup.trainer.sharding import build_sharded_model

    cfg = config_from_dict({"model": _model_for(state_mb), "checkpoint": {"dir": str(root), "keep_last": 1}})
    runtime = _runtime(init_runtime)
    model = build_sharded_model(cfg.model, 0, runtime.mesh, runtime.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()  # materialise the moments
    app = AppState(model, optimizer, TrainerState())
    checkpointer = Checkpointer(cfg.checkpoint, runtime)
    checkpointer.prepare()

    tokens = torch.randint(cfg.model.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))

    def forward_backward() -> float:
        t0 = time.perf_counter()
        model(tokens).float().logsumexp(-1).mean().backward()
        return time.perf_counter() - t0

    step = 1
    checkpointer.save(app, step, use_async=True)  # the first save allocates the host buffers
    checkpointer.finish()
    rows: dict[str, list[float]] = {k: [] for k in ("sync", "stall", "stall_loop", "write", "compute", "alone")}
    for _ in range(repeats):
        rows["alone"].append(forward_backward())
        step += 1
        t0 = time.perf_counter()
        checkpointer.save(app, step, use_async=False)
        rows["sync"].append(time.perf_counter() - t0)
        size = folder_bytes(step_dir(root, step))
        # Async, waited at once: the stall with nothing to overlap the copy with.
        step += 1
        t0 = time.perf_counter()
        call = checkpointer.save(app, step, use_async=True).stall_s
        rows["stall"].append(call + checkpointer.wait_staged())
        checkpointer.finish()
        rows["write"].append(time.perf_counter() - t0)
        # Async as the loop runs it: the next step's forward/backward overlaps the copy.
        step += 1
        call = checkpointer.save(app, step, use_async=True).stall_s
        rows["compute"].append(forward_backward())
        rows["stall_loop"].append(call + checkpointer.wait_staged())
        checkpointer.finish()
    checkpointer.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "state_mb": round(size / 1e6, 1),
        "sync_save_s": round(med["sync"], 4),
        "async_stall_s": round(med["stall"], 4),
        "async_stall_in_loop_s": round(med["stall_loop"], 4),
        "overlapped_compute_s": round(med["compute"], 4),
        "compute_alone_s": round(med["alone"], 4),
        "async_total_s": round(med["write"], 4),
        "stall_ratio": round(med["stall"] / med["sync"], 4),
        "stall_in_loop_ratio": round(med["stall_loop"] / med["sync"], 4),
        "repeats": repeats,
    }


_RUNTIME: Any = None


def _runtime(init_runtime: Any) -> Any:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = init_runtime({}, "auto", timeout=timedelta(minutes=5))
    return _RUNTIME


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench checkpoint", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="~100 MB only, 2 repeats (under a minute)")
    parser.add_argument("--sizes-mb", default="100,1000", help="comma-separated state sizes in MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where to write checkpoints (default: a temp dir, removed after)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [100.0] if args.quick else [float(s) for s in args.sizes_mb.split(",")]
    repeats = 2 if args.quick else args.repeats

    from regroup.telemetry import configure_logging

    configure_logging("warning")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="regroup-bench-ckpt-"))
    rows = []
    try:
        for size in sizes:
            root = base / f"{int(size)}mb"
            rows.append(measure(size, repeats, root))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(
        "| state | sync save (anchor) | async stall, no overlap | ratio "
        "| async stall, next step overlapping | ratio | async write total |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['state_mb']} MB | {r['sync_save_s']:.3f} s | {r['async_stall_s']:.3f} s | {r['stall_ratio']:.1%} "
            f"| {r['async_stall_in_loop_s']:.4f} s (fwd/bwd {r['overlapped_compute_s']:.2f} s, "
            f"{r['compute_alone_s']:.2f} s with no save) "
            f"| {r['stall_in_loop_ratio']:.2%} | {r['async_total_s']:.3f} s |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
