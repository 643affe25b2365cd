"""Launching real torchrun jobs of the trainer and reading what they left behind."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from regroup.elastic.checkpoint.folders import step_dir

# ~0.9M parameters: big enough for FSDP to shard every block, small enough for CI.
TINY_MODEL = {"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "seq_len": 32}


def write_config(path: Path, **sections: Any) -> Path:
    body: dict[str, Any] = {"model": dict(TINY_MODEL), "log_every": 1}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    path.write_text(yaml.safe_dump(body))
    return path


def torchrun_argv(nproc: int, config: Path, *overrides: str, max_restarts: int = 0) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        "-m",
        "regroup.trainer",
        "--config",
        str(config),
    ]
    for assignment in overrides:
        argv += ["--set", assignment]
    return argv


def torchrun(
    nproc: int, config: Path, env: dict[str, str], *overrides: str, max_restarts: int = 0, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a trainer job to completion; its stderr carries the JSON log lines."""
    return subprocess.run(
        torchrun_argv(nproc, config, *overrides, max_restarts=max_restarts),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class BackgroundTorchrun:
    """``torchrun`` of the trainer started in the background, its output to files beside
    ``out`` (not pipes nobody reads while it runs): e.g. the uninterrupted run a test
    compares with, training while the job under test starts and waits on its re-forms.
    ``stderr()`` waits for its end (``timeout`` from its start) and checks it exited 0."""

    def __init__(
        self, nproc: int, config: Path, env: dict[str, str], out: Path, *overrides: str, timeout: float = 300
    ) -> None:
        self.timeout = timeout
        self.stderr_path = out / "torchrun.stderr"
        with open(out / "torchrun.stdout", "wb") as stdout, open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(torchrun_argv(nproc, config, *overrides), env=env, stdout=stdout, stderr=stderr)
        self.deadline = time.monotonic() + timeout

    def stderr(self) -> str:
        """The run's stderr (it carries the JSON log lines), once it ended well."""
        try:
            code = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"torchrun did not end within {self.timeout:.0f}s") from None
        text = self.stderr_path.read_text(errors="replace")
        assert code == 0, f"exit {code} (wanted 0):\n{text[-6000:]}"
        return text

    def close(self) -> None:
        """End the run if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def events(log_text: str, name: str) -> list[dict[str, Any]]:
    """The JSON log events called ``name`` (other lines, e.g. torch warnings, skipped)."""
    found = []
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == name:
            found.append(event)
    return found


def step_losses(log_text: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(log_text, "step") if e.get("rank") == 0}


def full_state(checkpoint_root: Path, step: int, scratch: Path) -> dict[str, Any]:
    """The full (unsharded) state of a committed checkpoint, read without any process group."""
    out = scratch / f"full-{step}.pt"
    dcp_to_torch_save(str(step_dir(checkpoint_root, step)), str(out))
    return torch.load(out, weights_only=False)["app"]


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, dict):
            flat.update(flat_tensors(value, name + "."))
    return flat


def check(result: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    assert result.returncode == code, f"exit {result.returncode} (wanted {code}):\n{result.stderr[-6000:]}"
    return result


def run_all(argvs: Sequence[list[str]], logs: Sequence[Path], env: dict[str, str], cwd: Path, timeout: float) -> None:
    """Run each command as a process beside the others (its output to its log file, not a
    pipe nobody reads), wait for all within ``timeout``, kill what is left, and fail naming
    the first that did not exit 0 (-9: at the timeout), with its output."""
    procs = []
    for argv, log in zip(argvs, logs, strict=True):
        with log.open("w") as sink:
            procs.append(subprocess.Popen(argv, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):  # reported below, with the output
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"process {i} exited {proc.returncode} (-9: at the timeout):\n{log.read_text()[-3000:]}"
