"""Start the chain's processes (``bench.scale.chain``) beside a TCPStore on loopback and
collect what each recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bench.scale.chain import ChainSpec

REPO = Path(__file__).resolve().parents[2]


class ChainFailed(RuntimeError):
    """A process of the chain did not exit 0; the message carries its output's end."""


def run_chain(spec: dict[str, Any], procs: int, out: Path, timeout: float) -> list[list[dict[str, Any]]]:
    """Run ``procs`` processes of the chain (``spec``: ``ChainSpec`` fields but ``port``,
    ``procs`` and ``out``) and return each process's records."""
    out.mkdir(parents=True, exist_ok=True)
    # The store listens on a port the kernel picked: no port is guessed.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    chain = ChainSpec(port=store.port, procs=procs, out=str(out), **spec)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "bench.scale.chain", json.dumps(asdict(chain))]
    logs = [out / f"proc-{p}.log" for p in range(procs)]
    running = []
    for p, log in enumerate(logs):
        with log.open("w") as sink:
            running.append(subprocess.Popen([*argv, str(p)], env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        # One process failing leaves the others waiting on it in a collective: end them all then.
        while time.monotonic() < deadline and any(p.poll() is None for p in running):
            if any(p.poll() not in (None, 0) for p in running):
                break
            time.sleep(0.2)
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for p, (proc, log) in enumerate(zip(running, logs, strict=True)):
        if proc.returncode != 0:
            raise ChainFailed(f"process {p} exited {proc.returncode} (-9: at the timeout):\n{log.read_text()[-4000:]}")
    return [json.loads((out / f"proc-{p}.json").read_text()) for p in range(procs)]
