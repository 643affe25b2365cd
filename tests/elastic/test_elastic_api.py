"""The public API a user's own script is written against (``regroup.elastic``),
run as users run it: a script of its own (tests/elastic/api_script.py) in a process of its
own, alone, under torchrun, and under ``regroup-run`` with real etcd and real gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from tests.rendezvous.inplace_job import InPlaceJob, wait_for
from tests.elastic.harness import check, step_losses
from tests.elastic.test_resize import LOSS_RTOL

SCRIPT = Path(__file__).with_name("api_script.py")


def script(env: dict[str, str], *args: str, nproc: int = 0, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The script alone (``nproc`` 0) or under ``torchrun --standalone``."""
    launcher = [] if not nproc else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv = [sys.executable, *launcher, str(SCRIPT), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def final(output: str) -> dict[str, Any]:
    (line,) = [line for line in output.splitlines() if line.startswith('{"final"')]
    return json.loads(line)["final"]  # type: ignore[no-any-return]


def test_a_script_resumes_its_model_scheduler_and_extras_from_the_committed_checkpoint(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    env = {**worker_env, "REGROUP_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    first = check(script(env, "--wrap", "plain", "--steps", "4"))
    assert final(first.stdout) == {"step": 4, "lr": pytest.approx(0.05 / 5), "counter": 4}
    second = check(script(env, "--wrap", "plain", "--steps", "7"))
    assert '"event": "resumed"' in second.stderr and '"step": 4' in second.stderr
    # The scheduler and the registered counter went on from step 4, not from a fresh start.
    assert final(second.stdout) == {"step": 7, "lr": pytest.approx(0.05 / 8), "counter": 7}


@pytest.mark.slow
def test_the_global_batch_and_the_losses_do_not_depend_on_the_world_size_or_the_wrapper(
    worker_env: dict[str, str],
) -> None:
    """One rank unwrapped, two ranks of DDP loading from a DataLoader in epochs (over
    ``elastic.Sampler``, micro-batches of 3), three of FSDP2 with gradient accumulation, all
    with keyed dropout: the same samples and the same masks per step, so the same loss at
    every step, epochs (of three steps) crossed."""
    alone = step_losses(check(script(worker_env, "--wrap", "plain", "--steps", "6")).stderr)
    ddp = step_losses(
        check(script(worker_env, "--wrap", "ddp", "--steps", "6", "--loader", "--max-micro-batch", "3", nproc=2)).stderr
    )
    fsdp = step_losses(check(script(worker_env, "--wrap", "fsdp", "--steps", "6", "--max-micro-batch", "2", nproc=3)).stderr)
    assert sorted(alone) == sorted(ddp) == sorted(fsdp) == list(range(1, 7))
    for step, loss in alone.items():
        assert ddp[step] == pytest.approx(loss, rel=LOSS_RTOL), step
        assert fsdp[step] == pytest.approx(loss, rel=LOSS_RTOL), step


@pytest.mark.parametrize(
    ("misuse", "says"),
    [
        ("init", "remove init_process_group() and use elastic.world()"),
        ("two-runs", "one Run per world: create it once in the function that builds the model"),
        ("stale-step", "step.micro_batches() is for the step being trained"),
    ],
)
def test_misuse_is_a_clear_error_that_says_what_to_do(misuse: str, says: str, worker_env: dict[str, str]) -> None:
    result = script(worker_env, "--misuse", misuse, "--steps", "3")
    assert result.returncode != 0
    assert "MisuseError" in result.stderr and says in result.stderr, result.stderr[-2000:]


class ScriptJob(InPlaceJob):
    """``InPlaceJob`` whose nodes run the API script instead of the built-in trainer."""

    def __init__(self, *args: Any, script_args: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script_args = script_args
        self.env = {**self.env, "REGROUP_ETCD_ENDPOINT": self.endpoint, "REGROUP_CHECKPOINT_DIR": str(self.root / "ckpt")}

    nnodes = "1:3"

    def worker(self) -> list[str]:
        return [str(SCRIPT), *self.script_args]


STEPS = 100
"""Room for the loss to come late: the test sees the first snapshot by polling, and on a
loaded machine the job has trained some steps more by then (after the loss the world holds
at its first boundary, so nothing else runs away). The survivor trains the rest alone,
each step padded to the floor."""


@pytest.fixture
def script_job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[ScriptJob]:
    steps = ["--wrap", "ddp", "--steps", str(STEPS), "--floor", "50ms", "--progress-interval", "100ms"]
    job = ScriptJob(etcd.endpoint, tmp_path / "job", worker_env, script_args=steps)
    try:
        yield job
    finally:
        job.close()


@pytest.mark.slow
def test_a_script_keeps_its_scheduler_and_extras_across_in_place_reforms(script_job: ScriptJob) -> None:
    """A DDP script: a loss without notice (snapshots) and a planned shrink (hand-off)
    rebuild the model in memory; the scheduler and the registered counter come from a
    survivor, at the same step; and every model and optimizer tensor the script holds after
    a re-form is its own memory, not a view of a snapshot or of a message."""
    job = script_job
    job.expect(0, ["a", "b", "c"], "start")
    for node in ("a", "b", "c"):
        job.start(node)
    job.await_progress("3 ranks training with snapshots", lambda p: p.world_size == 3 and p.extra.get("snapshot_step"))
    pids = {node: job.workers(node) for node in ("a", "b")}

    job.kill_node("c")
    # The world the loss leaves trains one step, then answers this request and holds: the
    # steps left for the survivor to train alone do not depend on the machine's speed.
    job.ask_checkpoint(1)
    lost = job.await_progress("2 ranks after the loss", lambda p: p.world_size == 2 and p.step > p.resumed_from_step)
    assert lost.reform_mode == "in-place" and "reshard" in lost.resume_phases, lost.resume_phases

    job.claim_control()
    ack = job.acked(1)
    assert ack.step < STEPS, "the run must still have steps to train after the shrink"
    job.reform(1, ["a"], cause="reclaim")
    shrunk = job.await_progress("1 rank after the shrink", lambda p: p.world_size == 1)
    assert (shrunk.resumed_from_step, shrunk.reform_mode) == (ack.step, "in-place")
    assert "reshard" in shrunk.resume_phases, shrunk.resume_phases
    assert job.procs["a"].wait(120) == 0, job.log("a")[-3000:]
    assert pids["a"] == [] or job.events("a", "re-formed in place")
    # Had either re-form started the scheduler or the counter afresh, they would trail the step.
    assert final(job.log("a")) == {"step": STEPS, "lr": pytest.approx(0.05 / (STEPS + 1)), "counter": STEPS}
    restored = [json.loads(line)["restored"] for line in job.log("a").splitlines() if line.startswith('{"restored"')]
    assert [r["world_size"] for r in restored][-2:] == [2, 1], restored
    assert restored[-2]["step"] > 0 and restored[-1]["step"] == ack.step
    assert all(r["worst_ratio"] == 1.0 for r in restored), restored
    wait_for(lambda: job.procs["b"].poll() is not None, 60, "b's agent exiting once left out")
