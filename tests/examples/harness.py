"""The converted example scripts under test: launching them, reading what they left behind.

``ScriptJob`` is ``InPlaceJob`` (agents posing as nodes on a real etcd, the test playing the
controller by writing its records) whose agents run ``regroup-run ... <script> <args>``: a
user's own script on ``regroup.elastic`` instead of the built-in trainer. The
script gets its job's etcd from the agent (``REGROUP_ETCD_ENDPOINT``), its checkpoint
folder and sample log from ``REGROUP_CHECKPOINT_DIR`` and ``REGROUP_SAMPLE_LOG``. Every
run works in a folder of its own (upstream's FSDP2 example keeps its own ``checkpoints/``
in the working directory, and loads it at start).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from bench.chaos.invariants import Incarnation, kept_history, read_samples
from tests.conftest import REPO
from tests.rendezvous.inplace_job import InPlaceJob

EXAMPLES = REPO / "examples"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass(frozen=True)
class Example:
    """One converted script and small arguments for the tests."""

    name: str
    script: Path
    args: tuple[str, ...]
    global_batch: int
    """Samples per step: it must split over 1 and 2 ranks, the tests' world sizes."""
    summed: bool = False
    """The loss a rank reports is a sum over its share of the batch, not a mean (upstream's
    ``model(x).sum()``): a step's loss is then the sum over the ranks, not their mean."""
    steps: int = 40
    """Steps the arguments make the run train."""


def script_env(base: dict[str, str], root: Path) -> dict[str, str]:
    """The environment of a run of an example whose files go under ``root``."""
    env = {k: v for k, v in base.items() if not k.startswith(("REGROUP_", "TORCHELASTIC_"))}
    env.update(
        REGROUP_SAMPLE_LOG=str(root / "samples"),
        REGROUP_CHECKPOINT_DIR=str(root / "ckpt"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return env


class StraightRun:
    """The uninterrupted run to compare with: plain ``torchrun --standalone``, the same
    script and arguments, in the background (it trains while the job under test waits on
    its re-forms). ``close`` ends it if it still runs."""

    def __init__(self, example: Example, nproc: int, root: Path, base_env: dict[str, str]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        argv = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.1", str(example.script)]
        with open(root / "torchrun.log", "wb") as log:
            self.proc = subprocess.Popen(
                [*argv, *example.args], cwd=root, env=script_env(base_env, root), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait(self, timeout: float = 300) -> Path:
        """Wait for the run to end well; its sample log folder."""
        code = self.proc.wait(timeout)
        assert code == 0, (self.root / "torchrun.log").read_text(errors="replace")[-6000:]
        return self.root / "samples"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and its workers: a session of their own
            self.proc.wait()


@dataclass
class ScriptJob(InPlaceJob):
    """Agents of one job running an example script under ``regroup-run``."""

    example: Example | None = None
    pids: WorkerPids | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cwd = self.root  # upstream's own Checkpointer writes checkpoints/ in the cwd
        self.env = script_env(self.env, self.root)

    def watch_workers(self, nodes: list[str]) -> WorkerPids:
        """Watch the worker PIDs under these nodes' agents until the job is closed."""
        self.pids = WorkerPids(self, nodes)
        return self.pids

    def close(self) -> None:
        if self.pids is not None:
            self.pids.close()
        super().close()

    nnodes = "1:2"

    def worker(self) -> list[str]:
        assert self.example is not None
        return [str(self.example.script), *self.example.args]


class WorkerPids:
    """Every worker PID seen under each of some nodes' agents, watched in the background
    for the life of the job: a worker restarted at any time shows up as a second PID, even
    one restarted just before the job ends (a restarted worker lives for seconds)."""

    def __init__(self, job: InPlaceJob, nodes: list[str], every: float = 0.2) -> None:
        self.seen: dict[str, set[int]] = {node: set() for node in nodes}
        self._job, self._every = job, every
        self._stop = threading.Event()
        self._look()
        self._thread = threading.Thread(target=self._run, name="worker-pids", daemon=True)
        self._thread.start()

    def _look(self) -> None:
        for node, pids in self.seen.items():
            pids.update(self._job.workers(node))

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._look()

    def close(self) -> dict[str, set[int]]:
        """Stop watching (idempotent); what was seen."""
        self._stop.set()
        self._thread.join()
        return self.seen


# ------------------------------------------------------------------ the sample logs


def worlds(folder: Path) -> list[Incarnation]:
    """Every world's steps from the ``samples-w<W>-r<R>.jsonl`` files, oldest world first."""
    return read_samples(folder)


def steps_done(folder: Path, size: int) -> list[int]:
    """Steps that some rank of a world of ``size`` ranks completed."""
    return [step for world in worlds(folder) if world.world_size == size for step in world.steps]


def trained(folder: Path, max_steps: int, global_batch: int, summed: bool = False) -> dict[int, float]:
    """Check, as the fault campaign does (``kept_history``), that the kept history trains
    steps 1..max_steps, each by every rank of its world, and every sample id in
    [0, max_steps * global_batch) exactly once; return each step's loss: the mean of the
    ranks' losses, as the step boundary agrees it (``summed``: their sum, for losses that
    are sums over the rank's samples)."""
    history = kept_history(worlds(folder), global_batch)
    assert not history.findings, [finding.message for finding in history.findings]
    assert history.last_step == max_steps, f"steps kept: {sorted(history.kept)}"
    return {
        step: sum(world.losses[step].values()) / (1 if summed else world.world_size)
        for step, world in sorted(history.kept.items())
    }


# ------------------------------------------------------------------ the diffs


def diff_lines(upstream: Path, converted: Path) -> tuple[int, int]:
    """(lines removed, lines added) of ``diff upstream converted``."""
    out = subprocess.run(["diff", str(upstream), str(converted)], capture_output=True, text=True).stdout
    lines = out.splitlines()
    return sum(1 for l in lines if l.startswith("<")), sum(1 for l in lines if l.startswith(">"))


def unified_diff(upstream: Path, converted: Path) -> str:
    """``diff -u`` run from the example's folder, without the two time-stamped header lines."""
    out = subprocess.run(
        ["diff", "-u", str(upstream.relative_to(converted.parent)), converted.name],
        cwd=converted.parent,
        capture_output=True,
        text=True,
    ).stdout
    return "".join(out.splitlines(keepends=True)[2:])
