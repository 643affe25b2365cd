"""A compiled model, mixed precision with a ``GradScaler``, gradient clipping and a step-based
LR schedule through in-place re-forms: one job of ``tests/elastic/compiled_script.py`` under
``regroup-run`` agents on a real etcd (FSDP2, ``torch.compile(model)``), whose trajectory
must be an uninterrupted run's.

``torch.compile`` runs with ``backend="aot_eager"``: the same Dynamo capture and AOTAutograd
graphs as inductor without inductor's C++ build, which takes about 14 s per process on a
cold cache on 2 cores (1.2 s for aot_eager).

Every world trains micro-batches of 6 samples (two ranks one each, one rank two in turn), so
the bfloat16 matmuls see the same rows at every world size and the losses match the
uninterrupted run's exactly; with whole shares instead, a rank alone rounds a 12-row
matmul that two ranks round as two 6-row ones, and the losses drift apart by up to 1e-1
relative over a few hundred steps (bfloat16's noise, not the re-form's)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from tests.rendezvous.inplace_job import InPlaceJob
from tests.elastic.test_resize import LOSS_RTOL

SCRIPT = Path(__file__).with_name("compiled_script.py")
STEPS = 60
FEATURES = [
    "--wrap", "fsdp", "--compile", "wrap", "--amp", "--clip", "1", "--schedule", "onecycle", "--poison", "7",
    "--max-micro-batch", "6", "--steps", str(STEPS),
]  # fmt: skip
"""FSDP2, ``torch.compile(model)``, bfloat16 autocast with a GradScaler that skips every
7th step (an infinity in rank 0's gradient shard only), clipping at norm 1, OneCycleLR
(which cycles AdamW's betas as well as the lr)."""


def printed(text: str, kind: str) -> list[dict[str, Any]]:
    """The script's ``{kind: ...}`` lines, in order."""
    return [json.loads(line)[kind] for line in text.splitlines() if line.startswith(f'{{"{kind}"')]


def kept(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per step, the record of the newest world that trained it (a world that resumed from an
    older checkpoint trains some steps again)."""
    out: dict[int, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r["round"]):
        out[record["step"]] = record
    return out


class CompiledJob(InPlaceJob):
    """``InPlaceJob`` whose nodes run the compiled mixed-precision script."""

    nnodes = "1:2"

    def __init__(self, *args: Any, script_args: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script_args = script_args
        checkpoints = str(self.root / "ckpt")
        self.env = {**self.env, "REGROUP_ETCD_ENDPOINT": self.endpoint, "REGROUP_CHECKPOINT_DIR": checkpoints}

    def worker(self) -> list[str]:
        return [str(SCRIPT), *self.script_args]


@pytest.fixture
def compiled_job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[CompiledJob]:
    # A world of one leaves through storage: the grow after it loads the checkpoint.
    pace = ["--floor", "100ms", "--progress-interval", "100ms", "--storage-at", "1"]
    job = CompiledJob(etcd.endpoint, tmp_path / "job", worker_env, script_args=[*FEATURES, *pace])
    try:
        yield job
    finally:
        job.close()


def uninterrupted(env: dict[str, str]) -> subprocess.Popen[str]:
    """The same script alone, a world of one, no etcd and no checkpoints."""
    alone = {k: v for k, v in env.items() if not k.startswith("REGROUP_")}
    argv = [sys.executable, str(SCRIPT), *FEATURES]
    return subprocess.Popen(argv, env=alone, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_compiled_mixed_precision_run_keeps_its_trajectory_through_a_loss_and_a_grow(
    compiled_job: CompiledJob, worker_env: dict[str, str]
) -> None:
    """Two nodes; one is lost without notice and the survivor rebuilds the state in memory
    from the snapshots, alone; a third node joins (the world of one saved and held for it)
    and the grown world loads that checkpoint. Losses, gradient norms, lr, betas, the
    scaler's scale and growth tracker, the skipped steps and AdamW's step count are those of
    the same script run alone without a break, at every step and just after each restore."""
    job = compiled_job
    reference = uninterrupted(worker_env)
    try:
        job.claim_control()
        job.expect(0, ["a", "b"], "start")
        for node in ("a", "b", "c"):  # c is left out of the first world: its worker waits, warm
            job.start(node)
        job.await_progress("2 ranks with snapshots", lambda p: p.world_size == 2 and p.extra.get("snapshot_step"))
        job.kill_node("b")
        job.reform(1, ["a"], cause="node-lost")
        lost = job.await_progress("1 rank after the loss", lambda p: p.world_size == 1 and p.step > p.resumed_from_step)
        assert lost.reform_mode == "in-place" and "reshard" in lost.resume_phases, lost.resume_phases
        ack = job.checkpoint(2)  # saved, acked and held at that boundary until the grow
        job.await_joiner("c", after=0)
        job.reform(3, ["a", "c"], cause="grow")
        grown = job.await_progress("2 ranks after the grow", lambda p: p.world_size == 2 and p.step > ack.step)
        assert (grown.resumed_from_step, grown.reform_mode) == (ack.step, "in-place")
        assert "load" in grown.resume_phases and "reshard" not in grown.resume_phases, grown.resume_phases
        for node in ("a", "c"):
            assert job.procs[node].wait(120) == 0, job.log(node)[-3000:]
        out, err = reference.communicate(timeout=120)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert reference.returncode == 0, err[-3000:]

    expected = kept(printed(out, "trained"))
    assert sorted(expected) == list(range(1, STEPS + 1))
    # Counting, independently of the run: a step the scaler skipped is a step of the run (its
    # samples are spent, the schedule moves on) but not one of AdamW's.
    skipped = [step for step, r in expected.items() if r["skipped"]]
    assert skipped == [s for s in range(1, STEPS + 1) if (s - 1) % 7 == 3], skipped
    assert all(r["adam_step"] == 1 + step - sum(s <= step for s in skipped) for step, r in expected.items())

    logs = job.log("a") + job.log("c")
    trained = kept(printed(logs, "trained"))
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert {r["world_size"] for r in trained.values()} == {1, 2}
    for step, want in expected.items():
        got = trained[step]
        assert (got["skipped"], got["adam_step"], got["scale"], got["tracker"]) == (
            want["skipped"], want["adam_step"], want["scale"], want["tracker"],
        ), (step, got, want)  # fmt: skip
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12) and got["betas"] == pytest.approx(want["betas"]), step
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-5), step
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), step
    # Each world's restore: the schedule, the optimizer's settings and the scaler at the step it resumed.
    restored = [r for r in printed(logs, "restored") if r["step"] > 0]
    assert [(r["world_size"], r["step"]) for r in restored] == [(1, lost.resumed_from_step), (2, ack.step)], restored
    for r in restored:
        want = expected[r["step"]]
        assert (r["scale"], r["tracker"], r["adam_step"]) == (want["scale"], want["tracker"], want["adam_step"]), r
        assert r["lr"] == pytest.approx(want["lr"], rel=1e-12) and r["betas"] == pytest.approx(want["betas"]), r
