"""One run of each variant of ``bench script``: the anchor under plain ``torchrun``, the
converted example under four ``regroup-run`` agents on etcd, each watched by a CPU sampler
until every process has exited."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.script.cpu import CpuSampler
from bench.script.logs import Stamp, _json_lines, anchor_stamps, api_stamps, first_loss, global_batch_of
from bench.script.variants import ANCHOR, NODES, REPO, SCRIPT, WORLD, Settings
from regroup.demo.processes import kill_tree


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    # Each step's time and CPU come from rank 0's `step` log events: one a step, as the anchor logs.
    env["REGROUP_LOG_EVERY"] = "1"
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "REGROUP_CHECKPOINT_DIR"):
        env.pop(key, None)
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launcher this bench started and everything under it (``kill_tree``)."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait()


def _wait_all(procs: Mapping[str, subprocess.Popen[bytes]], timeout: float, logs: Mapping[str, Path]) -> list[str]:
    """Wait for every process; what failed, as ``name exited with N (log)``. A timeout raises."""
    deadline = time.monotonic() + timeout
    failed = []
    try:
        for name, proc in procs.items():
            left = deadline - time.monotonic()
            try:
                code = proc.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"{name} still running after {timeout:.0f}s; log: {logs[name]}") from exc
            if code != 0:
                failed.append(f"{name} exited with {code} ({logs[name]})")
    finally:
        for proc in procs.values():
            _kill_group(proc)
    return failed


def _check_complete(stamps: Sequence[Stamp], steps: int, failed: Sequence[str], log: Path) -> None:
    """A run counts when rank 0 logged every step; a process that failed after that (a crash
    on the way out) is reported, not fatal."""
    if len(stamps) < steps:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{len(stamps)} of {steps} steps logged; {'; '.join(failed) or 'no failure'}:\n{tail}")
    for failure in failed:
        print(f"warning: after all {steps} steps, {failure}", file=sys.stderr, flush=True)


def _timeout(settings: Settings) -> float:
    return 180 + 5 * settings.steps


def run_without(
    settings: Settings, root: Path, wrap: list[str] | None = None, extra_env: Mapping[str, str] | None = None,
    synced: bool = False,
) -> dict[str, Any]:
    """The anchor under plain ``torchrun --standalone``: its rank-0 stamps and CPU samples
    (``synced``: it also all-reduces its loss every step)."""
    cwd = Path(tempfile.mkdtemp(prefix="without-", dir=root))
    log = cwd / "torchrun.log"
    worker = [*(wrap or []), str(ANCHOR), f"--global-batch={settings.global_batch}", f"--steps={settings.steps}"]
    worker += ["--all-reduce-loss"] if synced else []
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", *worker]
    with open(log, "wb") as out:
        env = {**base_env(), **(extra_env or {})}
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, env=env)
    sampler = CpuSampler({"torchrun": proc.pid}, marker=ANCHOR.name, count=WORLD)
    sampler.start()
    try:
        failed = _wait_all({"torchrun": proc}, _timeout(settings), {"torchrun": log})
    finally:
        sampler.stop()
    text = log.read_text(errors="replace")
    _check_complete(anchor_stamps(text), settings.steps, failed, log)
    pids = {int(v["pid"]) for v in _json_lines(text) if "pid" in v and "cpu_s" in v}
    return {
        "stamps": anchor_stamps(text), "samples": sampler.samples, "rank0": next(iter(pids), None), "log": log,
        "first_loss": first_loss(text), "failed": failed,
    }  # fmt: skip


def run_with(
    settings: Settings, root: Path, endpoint: str, job: str, etcd_pid: int | None,
    wrap: list[str] | None = None, script: Path = SCRIPT, extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The converted example under four ``regroup-run`` agents (nodes n0..n3) on etcd."""
    env = {**base_env(), **(extra_env or {})}
    # Its own folder: the script's upstream checkpointer writes ./checkpoints and resumes from it.
    cwd = root / job
    cwd.mkdir()
    env["REGROUP_CHECKPOINT_DIR"] = str(cwd / "regroup-checkpoints")
    worker = [*(wrap or []), str(script), *settings.script_args]
    argv = [
        sys.executable, "-m", "regroup.rendezvous.inplace.launcher", "--standby",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
        f"--nnodes={WORLD}", "--nproc-per-node=1", "--local-addr=127.0.0.1", *worker,
    ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {node: root / f"{job}-{node}.log" for node in NODES}
    try:
        for node in NODES:
            with open(logs[node], "wb") as out:
                procs[node] = subprocess.Popen(
                    argv, env={**env, "NODE_NAME": node}, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, cwd=cwd,
                )  # fmt: skip
    except BaseException:
        for proc in procs.values():
            _kill_group(proc)
        raise
    roots = {n: p.pid for n, p in procs.items()}
    sampler = CpuSampler(roots, marker=SCRIPT.name, count=WORLD, extra=[etcd_pid] if etcd_pid else [])
    sampler.start()
    try:
        failed = _wait_all(procs, _timeout(settings), logs)
    finally:
        sampler.stop()
    by_node = {node: api_stamps(logs[node].read_text(errors="replace")) for node in NODES}
    node0 = max(by_node, key=lambda n: len(by_node[n]))
    _check_complete(by_node[node0], settings.steps, failed, logs[node0])
    rank0 = [pid for pid, label in sampler.owner.items() if label == node0]
    trained = global_batch_of(logs[node0].read_text(errors="replace"))
    if trained != settings.global_batch:
        raise RuntimeError(
            f"{SCRIPT.name} trained a global batch of {trained}, the anchor {settings.global_batch}: "
            f"give --global-batch {trained}"
        )
    return {
        "stamps": by_node[node0],
        "samples": sampler.samples,
        "rank0": rank0[0] if len(rank0) == 1 else None,
        "log": logs[node0],
        "first_loss": first_loss(logs[node0].read_text(errors="replace")),
        "failed": failed,
    }


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _script_flags() -> str:
    """The converted example's ``--help``, to build its command line from its own flags."""
    argv = [sys.executable, str(SCRIPT), "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, env=base_env(), timeout=120)
    return result.stdout


def script_args(global_batch: int, steps: int) -> list[str]:
    """``examples/fsdp2/train.py``'s flags for this global batch and step count (a script
    without a batch flag keeps its own: ``global_batch_of`` checks it after the run)."""
    flags = _script_flags()
    batch = next((f for f in ("--global-batch", "--batch-size") if f in flags), None)
    count = next((f for f in ("--max-steps", "--steps") if f in flags), None)
    if count is None:
        raise RuntimeError(f"examples/fsdp2/train.py: found no step-count flag in its --help:\n{flags}")
    return [*([f"{batch}={global_batch}"] if batch else []), f"{count}={steps}"]
