"""Step time and tokens/s of the trainer at several world sizes (CPU), and MFU on a GPU.

``python -m bench training [--quick] [--worlds 1,2,4] [--steps N] [--json PATH]``

Each world size is a real ``torchrun --standalone`` job of ``python -m regroup.trainer`` with the
same model and the same global batch (so the same work per step); the step time is the
median wall time between consecutive ``step`` log events of rank 0 after warm-up,
which includes everything the loop does per step. World 1 is the anchor: the table
reports each world's tokens/s relative to it.

With CUDA present the run uses every GPU, a ~1B-parameter decoder in bf16 (FSDP2,
torch.compile) and also reports model FLOPs utilisation against the GPU's dense bf16
peak (``--peak-tflops`` overrides the table below).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

CPU_MODEL = {"vocab_size": 256, "dim": 256, "n_layers": 4, "n_heads": 8, "seq_len": 128}
# ~0.94B parameters: 16 x (4 d^2 + 3 d h) + 2 V d with d=2048, h=5504, V=32000.
GPU_MODEL = {
    "vocab_size": 32000,
    "dim": 2048,
    "n_layers": 16,
    "n_heads": 16,
    "seq_len": 2048,
    "compile": True,
}
# Dense bf16 tensor-core peak per GPU, from the vendors' data sheets (SXM parts).
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1}


def run_world(world: int, cfg: dict[str, Any], steps: int, workdir: Path) -> dict[str, Any]:
    config = workdir / f"w{world}.yaml"
    config.write_text(yaml.safe_dump({**cfg, "max_steps": steps, "log_every": 1}))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    argv += ["-m", "regroup.trainer", "--config", str(config)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"world {world} failed:\n{result.stderr[-4000:]}")
    stamps = []
    for line in result.stderr.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "step" and event.get("rank") == 0:
                stamps.append(datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp())
    warmup = min(3, len(stamps) - 2)
    gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]
    step_s = statistics.median(gaps)
    tokens = cfg["batch"]["global_batch_size"] * cfg["model"]["seq_len"]
    return {"world": world, "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1), "steps": len(gaps)}


def gpu_peak(override: float | None) -> tuple[str, float | None]:
    import torch

    name = torch.cuda.get_device_name(0)
    if override:
        return name, override * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return name, tflops * 1e12
    return name, None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench training", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="worlds 1 and 2, 8 steps (under a minute)")
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (CPU)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, help="GPU dense bf16 peak per device, TFLOP/s")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)

    import torch

    from regroup.trainer.config import ModelConfig
    from regroup.trainer.model import flops_per_token

    cuda = torch.cuda.is_available()
    if cuda:
        worlds = [torch.cuda.device_count()]
        model = dict(GPU_MODEL)
        cfg = {"model": model, "batch": {"global_batch_size": 8 * worlds[0], "max_micro_batch_size": 4}}
        cfg["optim"] = {"warmup_steps": 2}
    else:
        worlds = [1, 2] if args.quick else [int(w) for w in args.worlds.split(",")]
        model = dict(CPU_MODEL)
        cfg = {"model": model, "batch": {"global_batch_size": 8}}
    steps = 8 if args.quick else args.steps
    rows = []
    with tempfile.TemporaryDirectory(prefix="regroup-bench-train-") as tmp:
        for world in worlds:
            rows.append(run_world(world, cfg, steps, Path(tmp)))
    anchor = rows[0]["tokens_per_s"]
    fpt = flops_per_token(ModelConfig(**model))
    peak_name, peak = gpu_peak(args.peak_tflops) if cuda else ("cpu", None)
    print(f"device: {peak_name}; model: {model}; global batch: {cfg['batch']['global_batch_size']}")
    print("| world | step time | tokens/s | vs world " + str(rows[0]["world"]) + " | MFU |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["vs_anchor"] = round(r["tokens_per_s"] / anchor, 3)
        r["mfu"] = round(r["tokens_per_s"] * fpt / (peak * r["world"]), 4) if peak else None
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (CPU)"
        print(f"| {r['world']} | {r['step_s']:.3f} s | {r['tokens_per_s']:.0f} | {r['vs_anchor']:.2f}x | {mfu} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
