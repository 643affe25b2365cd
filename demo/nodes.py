"""What runs on each local node: the torchrun command, its environment, the trainer config.

Each rank runs the built-in trainer (``-m regroup.trainer --config trainer.yaml``) or the
user's own script (``regroup demo --script train.py``; see ``worker_command``). Either way
every worker finds the run's etcd, checkpoint folder and sample-log folder in its
environment (``worker_env``).

Three modes play the same scenario with the same worker command and checkpoint cadence:

- ``regroup``: ``regroup-run --standby`` (torchrun whose workers survive re-forms in
  place; ``--standby`` starts them before the agent joins, so a spare waits with its
  workers warm) with the ``etcd-v3`` rendezvous, driven by the controller;
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
import re
import sys
from collections.abc import Sequence
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
SPARE_NODES_CONF = "spare_nodes"
"""The etcd-v3 rendezvous' ``--rdzv-conf`` key for the spares a job wants."""
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

ETCD_ENDPOINT_ENV = "REGROUP_ETCD_ENDPOINT"
"""The job's etcd (``host:port[,host:port]``); the job name comes from torchrun's
``TORCHELASTIC_RUN_ID``, the namespace from ``POD_NAMESPACE``."""
CHECKPOINT_DIR_ENV = "REGROUP_CHECKPOINT_DIR"
"""The run's checkpoint folder (``step-N/`` folders with their ``COMMITTED`` marker)."""
SAMPLE_LOG_ENV = "REGROUP_SAMPLE_LOG"
"""Folder for per-rank sample logs ``samples-w{W}-r{R}.jsonl`` (the built-in trainer's
``data.sample_log`` format: one JSON line per step, ``{"step", "ids", "restart", "round", "t"}``)."""


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
    def rounds(self) -> Path:
        """Every round formed: its nodes in rank order (a replacement in its predecessor's place)."""
        return self.root / "rounds.jsonl"

    @property
    def samples(self) -> Path:
        """Per-rank sample logs (``REGROUP_SAMPLE_LOG``, the built-in trainer's ``data.sample_log``)."""
        return self.root / "samples"

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


def pod_annotations(scenario: Scenario, etcd_endpoint: str) -> dict[str, str]:
    """What every worker pod of the job carries (DESIGN contract 1): the job's annotations,
    ``regroup.dev/spare-nodes`` included, and the run's etcd as its rendezvous endpoint."""
    return {**scenario.job.annotations(), "regroup.dev/rdzv-endpoint": etcd_endpoint}


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


def worker_env(layout: RunLayout, etcd_endpoint: str | None) -> dict[str, str]:
    """What every worker (the built-in trainer or a user's script) finds in its environment,
    besides torchrun's own variables and ``REGROUP_SPANS_FILE`` (``base_env``)."""
    env = {CHECKPOINT_DIR_ENV: str(layout.checkpoints), SAMPLE_LOG_ENV: str(layout.samples)}
    if etcd_endpoint:
        env[ETCD_ENDPOINT_ENV] = etcd_endpoint
    return env


class ScriptError(ValueError):
    """A training command the demo cannot run; the message says what to give instead."""


_PYTHON = re.compile(r"python(\d+(\.\d+)*)?(\.exe)?")
_LAUNCHERS = ("torchrun", "regroup-run", "regroup-train")


def worker_command(script: str | None, args: Sequence[str], cwd: Path | None = None) -> list[str]:
    """The training part of torchrun's command line for a user's script (what follows
    torchrun's own flags): ``--script PATH [args]``, or a command given after ``--``.

    ``python train.py ...`` and ``python -m pkg.train ...`` run under the demo's own Python
    (``sys.executable``, as torchrun does); ``train.py ...`` likewise; any other program is
    run as it is (torchrun's ``--no-python``). Raises ``ScriptError`` naming the problem.
    """
    cwd = Path.cwd() if cwd is None else cwd
    tokens = list(args)
    if script is not None:
        return [_existing_script(script, cwd), *tokens]
    if not tokens:
        raise ScriptError("no training command: give --script PATH, or the command after --")
    name = Path(tokens[0]).name
    if name in _LAUNCHERS:
        raise ScriptError(f"{tokens[0]}: the demo starts the agents itself; give only the training command (python train.py ...)")
    python = _PYTHON.fullmatch(name) is not None
    if python:
        tokens = tokens[1:]
        if not tokens:
            raise ScriptError(f"{name}: no script to run (python train.py ..., or python -m module ...)")
        if tokens[0].startswith("-") and tokens[0] != "-m":
            raise ScriptError(
                f"python option {tokens[0]} is not supported: the demo runs the script with its own Python "
                f"({sys.executable}); give a script path or -m module"
            )
    if tokens[0] == "-m":
        if len(tokens) < 2:
            raise ScriptError("-m: no module named")
        return tokens
    if python or tokens[0].endswith(".py"):
        return [_existing_script(tokens[0], cwd), *tokens[1:]]
    # Not Python: torchrun runs it as it is (a wrapper script or a binary).
    program = cwd / tokens[0]
    return ["--no-python", str(program.resolve()) if program.is_file() else tokens[0], *tokens[1:]]


def _existing_script(path: str, cwd: Path) -> str:
    script = cwd / path
    if not script.is_file():
        raise ScriptError(f"{path}: no such script")
    return str(script.resolve())


def torchrun_argv(
    scenario: Scenario,
    mode: Mode,
    rdzv_endpoint: str,
    config: Path | None,
    monitor_interval: float = 0.1,
    *,
    worker: Sequence[str] | None = None,
) -> list[str]:
    """The agent's command line. Each rank runs ``worker`` (a user's script, see
    ``worker_command``) or, without one, the built-in trainer with ``config``."""
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
        if job.spare_nodes:
            # How many spares the job wants, for the rendezvous' own report when no
            # controller is there; the policy is the same without it.
            argv.append(f"--rdzv-conf={SPARE_NODES_CONF}={job.spare_nodes}")
        argv.append("--rdzv-backend=etcd-v3")
    else:
        # Every agent is a client of the standalone store.
        argv += ["--rdzv-backend=c10d", "--rdzv-conf=is_host=false"]
    if worker:
        return argv + list(worker)
    if config is None:
        raise ValueError("torchrun_argv: give the built-in trainer's config or a worker command")
    return argv + ["-m", "regroup.trainer", "--config", str(config)]


def make_launcher(
    scenario: Scenario,
    mode: Mode,
    layout: RunLayout,
    rdzv_endpoint: str,
    config: Path | None,
    *,
    worker: Sequence[str] | None = None,
    etcd_endpoint: str | None = None,
) -> AgentLauncher:
    """The ``AgentLauncher`` the local cluster starts each node's agent with.

    ``etcd_endpoint``: the run's etcd, for the workers' ``REGROUP_ETCD_ENDPOINT`` (default:
    ``rdzv_endpoint`` in the modes whose rendezvous is on etcd)."""
    argv = torchrun_argv(scenario, mode, rdzv_endpoint, config, worker=worker)
    etcd = etcd_endpoint or (rdzv_endpoint if mode in CONTROLLED else None)
    env = {**base_env(layout), **worker_env(layout, etcd)}

    def launch(node: str, pod: str, attempt: int) -> AgentCommand:
        node_env = {
            **env,
            "NODE_NAME": node,
            "POD_NAME": pod,
            "POD_NAMESPACE": NAMESPACE,
            "OTEL_SERVICE_NAME": f"regroup-trainer-{node}",
        }
        # A script's relative paths are its node's own (as on a cluster): one folder per node.
        cwd = layout.root / "nodes" / node if worker else None
        if cwd is not None:
            cwd.mkdir(parents=True, exist_ok=True)
        return AgentCommand(argv=list(argv), env=node_env, log_path=layout.logs / f"{node}.log", cwd=cwd)

    return launch
