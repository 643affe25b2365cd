"""What runs on each local node: the torchrun command, its environment, the trainer config.

Three modes play the same scenario with the same trainer and checkpoint cadence:

- ``regroup``: ``regroup-run --standby`` (torchrun whose workers survive re-forms in
  place) with the ``etcd-v3`` rendezvous, driven by the controller;
- ``regroup-restart``: plain torchrun (``torch.distributed.run``) with the same ``etcd-v3``
  rendezvous and controller: every re-form restarts every worker (the restart path);
- ``torchrun-c10d``: plain torchrun with its c10d rendezvous and no controller. Its
  store is a standalone ``TCPStore`` (``regroup.demo.c10d_store``), the way a platform
  would run a rendezvous service, so losing the first node does not take it away.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from regroup.demo.processes import AgentCommand, AgentLauncher
from regroup.demo.scenario import Scenario
from regroup.telemetry import SPANS_FILE_ENV

Mode = Literal["regroup", "regroup-restart", "torchrun-c10d"]
MODES: tuple[str, ...] = ("regroup", "regroup-restart", "torchrun-c10d")
CONTROLLED: tuple[str, ...] = ("regroup", "regroup-restart")
"""Modes with the etcd-v3 rendezvous and the controller."""
NAMESPACE = "default"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Small enough that four ranks share two CPU cores, slow enough to watch; the global
# batch of 12 divides by every world size the default scenario passes through.
DEFAULT_TRAINER: dict[str, Any] = {
    "model": {"vocab_size": 128, "dim": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32},
    "batch": {"global_batch_size": 12},
    "optim": {"lr": 3e-3, "warmup_steps": 10},
    "checkpoint": {"every_steps": 20, "keep_last": 3},
    "etcd": {"progress_interval": "250ms"},
    "max_steps": 100000,
    "step_time_floor": "200ms",
    "log_every": 10,
    "device": "cpu",
}


def append_jsonl(path: Path, body: dict[str, Any]) -> None:
    """Append ``body`` to one of a run's JSON-lines files."""
    with open(path, "a") as out:
        out.write(json.dumps(body, separators=(",", ":")) + "\n")


@dataclass(frozen=True)
class RunLayout:
    """Where one run keeps its files."""

    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def trainer_config(self) -> Path:
        return self.root / "trainer.yaml"

    @property
    def spans(self) -> Path:
        return self.root / "spans.jsonl"

    @property
    def progress(self) -> Path:
        return self.root / "progress.jsonl"

    @property
    def members(self) -> Path:
        return self.root / "members.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def meta(self) -> Path:
        return self.root / "run.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``over`` into a copy of ``base``."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_trainer_config(scenario: Scenario, layout: RunLayout, etcd_endpoint: str) -> Path:
    """The trainer's YAML for this run: demo defaults, the scenario's overrides, this run's paths."""
    config = merge(DEFAULT_TRAINER, scenario.trainer)
    config = merge(
        config,
        {
            "checkpoint": {"dir": str(layout.checkpoints)},
            "etcd": {"endpoint": etcd_endpoint, "job": scenario.job.name, "namespace": NAMESPACE},
        },
    )
    layout.trainer_config.parent.mkdir(parents=True, exist_ok=True)
    layout.trainer_config.write_text(yaml.safe_dump(config, sort_keys=False))
    return layout.trainer_config


def base_env(layout: RunLayout) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env[SPANS_FILE_ENV] = str(layout.spans)
    # The demo collects traces in its own file; an OTLP endpoint in the caller's shell would
    # send the local run's spans to a real collector.
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env.pop(key, None)
    return env


def torchrun_argv(
    scenario: Scenario, mode: Mode, rdzv_endpoint: str, config: Path, monitor_interval: float = 0.1
) -> list[str]:
    job = scenario.job
    launcher = ["-m", "regroup.rendezvous.inplace.launcher", "--standby"] if mode == "regroup" else ["-m", "torch.distributed.run"]
    argv = [
        sys.executable, *launcher,
        f"--nnodes={job.min_nodes}:{job.max_nodes}",
        f"--nproc-per-node={job.nproc_per_node}",
        f"--max-restarts={job.max_restarts}",
        f"--monitor-interval={monitor_interval}",
        f"--rdzv-id={job.name}",
        f"--rdzv-endpoint={rdzv_endpoint}",
    ]  # fmt: skip
    if mode in CONTROLLED:
        argv.append("--rdzv-backend=etcd-v3")
    else:
        # Every agent is a client of the standalone store.
        argv += ["--rdzv-backend=c10d", "--rdzv-conf=is_host=false"]
    return argv + ["-m", "regroup.trainer", "--config", str(config)]


def make_launcher(scenario: Scenario, mode: Mode, layout: RunLayout, rdzv_endpoint: str, config: Path) -> AgentLauncher:
    """The ``AgentLauncher`` the local cluster starts each node's agent with."""
    argv = torchrun_argv(scenario, mode, rdzv_endpoint, config)
    env = base_env(layout)

    def launch(node: str, pod: str, attempt: int) -> AgentCommand:
        node_env = {
            **env,
            "NODE_NAME": node,
            "POD_NAME": pod,
            "POD_NAMESPACE": NAMESPACE,
            "OTEL_SERVICE_NAME": f"regroup-trainer-{node}",
        }
        return AgentCommand(argv=list(argv), env=node_env, log_path=layout.logs / f"{node}.log")

    return launch
