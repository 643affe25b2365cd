"""``regroup smoke``: is this node pool fit to train on?

One all-reduce check and two measurements, per rank:

- **wiring**: every rank all-reduces its ``rank + 1``; the sum must be
  ``n (n + 1) / 2`` or the run fails. Catches a wrong NCCL interface, a missing
  rendezvous backend or a half-formed group before a real job burns hours on it.
- **matmul**: dense ``N x N`` matmuls in bf16 (fp32 on CPU) give TFLOP/s per device and
  MFU against the device's dense bf16 peak.
- **all-reduce**: a large all-reduce gives bus bandwidth as nccl-tests defines it
  (``algbw * 2 (n - 1) / n``), comparable across world sizes.

Under ``torchrun`` it uses the group torchrun set up (NCCL on GPUs, gloo on CPU);
run alone it forms a one-rank gloo group in memory, a wiring check of the image.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s.
# Matched by substring of torch.cuda.get_device_name(), most specific first.
DENSE_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


def dense_bf16_peak(device_name: str) -> float | None:
    """The datasheet dense bf16 peak of a GPU by its name, or None when unknown."""
    for needle, peak in DENSE_BF16_PEAK_TFLOPS:
        if needle in device_name:
            return peak
    return None


@dataclass(frozen=True)
class SmokeSettings:
    """What one smoke run measures."""

    matmul_size: int
    """Side N of the square matmul operands."""
    matmul_iters: int
    """Timed matmuls (after ``warmup`` untimed ones)."""
    allreduce_mib: float
    """Size of the timed all-reduce buffer, MiB."""
    allreduce_iters: int
    """Timed all-reduces (after ``warmup`` untimed ones)."""
    warmup: int
    """Untimed iterations before each measurement."""
    peak_tflops: float | None
    """Dense peak to compute MFU against; None: look the device up."""
    timeout: timedelta
    """Deadline of each collective."""

    def __post_init__(self) -> None:
        for name in ("matmul_size", "matmul_iters", "allreduce_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"SmokeSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"SmokeSettings.warmup must be >= 0, got {self.warmup}")
        if self.allreduce_mib <= 0:
            raise ValueError(f"SmokeSettings.allreduce_mib must be > 0, got {self.allreduce_mib}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"SmokeSettings.peak_tflops must be > 0, got {self.peak_tflops}")


@dataclass(frozen=True)
class RankResult:
    """What one rank measured."""

    rank: int
    host: str
    device: str
    dtype: str
    matmul_tflops: float
    peak_tflops: float | None
    mfu: float | None
    allreduce_ok: bool


@dataclass(frozen=True)
class SmokeReport:
    """The whole run, as rank 0 prints it."""

    world_size: int
    backend: str
    ranks: list[RankResult]
    allreduce_bytes: int
    algbw_gbps: float
    busbw_gbps: float

    @property
    def ok(self) -> bool:
        return all(r.allreduce_ok for r in self.ranks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matmul-size", type=int, default=None, help="matmul side N (default 8192 on GPU, 256 on CPU)")
    parser.add_argument("--matmul-iters", type=int, default=None, help="timed matmuls (default 50 on GPU, 3 on CPU)")
    parser.add_argument("--allreduce-mib", type=float, default=None, help="all-reduce size in MiB (default 256 GPU, 1 CPU)")
    parser.add_argument("--allreduce-iters", type=int, default=None, help="timed all-reduces (default 20 GPU, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5 GPU, 1 CPU)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense peak for MFU (default: looked up by GPU name)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each collective may take (default 300)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def settings_from_args(args: argparse.Namespace, on_gpu: bool) -> SmokeSettings:
    """Defaults sized for the device: a real measurement on GPUs, a quick wiring check on CPU."""

    def pick(value: float | None, gpu: float, cpu: float) -> float:
        return value if value is not None else (gpu if on_gpu else cpu)

    return SmokeSettings(
        matmul_size=int(pick(args.matmul_size, 8192, 256)),
        matmul_iters=int(pick(args.matmul_iters, 50, 3)),
        allreduce_mib=float(pick(args.allreduce_mib, 256, 1)),
        allreduce_iters=int(pick(args.allreduce_iters, 20, 3)),
        warmup=int(pick(args.warmup, 5, 1)),
        peak_tflops=args.peak_tflops,
        timeout=timedelta(seconds=args.timeout),
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul(device: torch.device, dtype: torch.dtype, settings: SmokeSettings) -> float:
    """TFLOP/s of ``settings.matmul_iters`` dense N x N matmuls on ``device``."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    n = settings.matmul_size
    a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(settings.warmup):
        torch.matmul(a, b, out=out)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(settings.matmul_iters):
        torch.matmul(a, b, out=out)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    return 2.0 * n**3 * settings.matmul_iters / elapsed / 1e12


def check_allreduce(device: torch.device, rank: int, world_size: int) -> bool:
    """All-reduce ``rank + 1`` everywhere; True when every rank sees ``n (n + 1) / 2``."""
    value = torch.full((1024,), float(rank + 1), device=device, dtype=torch.float32)
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    return bool(torch.all(value == expected).item())


def measure_allreduce(device: torch.device, world_size: int, settings: SmokeSettings) -> tuple[int, float, float]:
    """(bytes, algbw GB/s, busbw GB/s) of an fp32 all-reduce of ``allreduce_mib``."""
    numel = max(1, int(settings.allreduce_mib * 2**20) // 4)
    buffer = torch.ones(numel, device=device, dtype=torch.float32)
    for _ in range(settings.warmup):
        dist.all_reduce(buffer)
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(settings.allreduce_iters):
        dist.all_reduce(buffer)
    _synchronize(device)
    elapsed = (time.perf_counter() - start) / settings.allreduce_iters
    size = numel * 4
    algbw = size / elapsed / 1e9
    return size, algbw, algbw * 2 * (world_size - 1) / world_size


def _init_group(on_gpu: bool, timeout: timedelta) -> tuple[int, int, torch.device, bool]:
    """Join torchrun's group when launched by it, else form a one-rank group in memory."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    backend = "nccl" if on_gpu else "gloo"
    owned = not dist.is_initialized()
    if owned:
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device, owned


def run_smoke(settings: SmokeSettings, on_gpu: bool) -> SmokeReport | None:
    """Measure on this rank; rank 0 gets the whole report, other ranks None."""
    rank, world_size, device, owned = _init_group(on_gpu, settings.timeout)
    try:
        dtype = torch.bfloat16 if on_gpu else torch.float32
        device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
        peak = settings.peak_tflops if settings.peak_tflops is not None else (
            dense_bf16_peak(device_name) if on_gpu else None
        )
        allreduce_ok = check_allreduce(device, rank, world_size)
        tflops = measure_matmul(device, dtype, settings)
        size, algbw, busbw = measure_allreduce(device, world_size, settings)
        mine = RankResult(
            rank=rank,
            host=os.environ.get("NODE_NAME") or socket.gethostname(),
            device=device_name,
            dtype=str(dtype).removeprefix("torch."),
            matmul_tflops=tflops,
            peak_tflops=peak,
            mfu=tflops / peak if peak else None,
            allreduce_ok=allreduce_ok,
        )
        gathered: list[RankResult | None] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        if rank != 0:
            return None
        return SmokeReport(
            world_size=world_size,
            backend=dist.get_backend(),
            ranks=[r for r in gathered if r is not None],
            allreduce_bytes=size,
            algbw_gbps=algbw,
            busbw_gbps=busbw,
        )
    finally:
        if owned:
            dist.destroy_process_group()


def format_report(report: SmokeReport) -> str:
    """A table per rank, then bandwidth and the verdict."""
    lines = [f"regroup smoke: world size {report.world_size}, backend {report.backend}"]
    lines.append(f"{'rank':>4}  {'host':<24} {'device':<28} {'dtype':<9} {'TFLOP/s':>9} {'MFU':>7}  all-reduce")
    for r in report.ranks:
        mfu = f"{r.mfu:7.1%}" if r.mfu is not None else f"{'n/a':>7}"
        lines.append(
            f"{r.rank:>4}  {r.host[:24]:<24} {r.device[:28]:<28} {r.dtype:<9} {r.matmul_tflops:9.2f} {mfu}  "
            f"{'ok' if r.allreduce_ok else 'WRONG SUM'}"
        )
    lines.append(
        f"all-reduce {report.allreduce_bytes / 2**20:.0f} MiB: algbw {report.algbw_gbps:.2f} GB/s, "
        f"busbw {report.busbw_gbps:.2f} GB/s"
    )
    lines.append("verdict: ok" if report.ok else "verdict: FAILED (all-reduce returned a wrong sum)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``regroup smoke``: 0 when every rank's all-reduce was right."""
    on_gpu = torch.cuda.is_available()
    try:
        settings = settings_from_args(args, on_gpu)
    except ValueError as error:
        print(f"regroup smoke: {error}", file=sys.stderr)
        return 2
    report = run_smoke(settings, on_gpu)
    if report is None:
        return 0
    if args.json:
        payload = asdict(report)
        payload["ok"] = report.ok
        print(json.dumps(payload, sort_keys=True))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regroup.elastic.smoke", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
