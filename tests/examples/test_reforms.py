"""The converted upstream scripts survive re-forms in place, as the built-in trainer does.

Real etcd, real ``regroup-run`` agents posing as two nodes, real gloo; the test plays the
controller by writing its records. For each example: a node SIGKILLed mid-training costs
at most one step (in-memory snapshots), the job grows back to two nodes and then shrinks
to one on a planned reclaim (checkpoint request with hold, ack, re-form) losing no step,
the survivor keeps its process throughout, and the kept history trains every sample
exactly once with the per-step losses of an uninterrupted ``torchrun`` run of the script
(run beside the job, while it waits on its re-forms).

The world sizes are 2 and 1 (upstream's global batch of 32 splits over them). Training runs free
only until the node is killed: each later checkpoint request is written before the world
that answers it forms, so that world trains one step, then saves and holds, and a busy
machine cannot use up the steps before the test reaches its next re-form.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from regroup.demo.etcd_server import EtcdServer
from regroup.rendezvous.inplace.agent import LEFT_OUT
from tests.examples.harness import (
    EXAMPLES,
    Example,
    ScriptJob,
    StraightRun,
    steps_done,
    trained,
    worlds,
)
from tests.rendezvous.inplace_job import wait_for
from tests.elastic.test_resize import LOSS_RTOL
from tests.scratch import scratch

pytestmark = pytest.mark.slow

STEPS = 40
"""Room for the kill to come late: the test sees step KILL_AFTER by polling the sample logs,
and on a loaded machine the job has trained a dozen steps more by then (after the kill
every world holds at its first boundary, so nothing else runs away)."""
KILL_AFTER = 3
"""Steps every rank of the first world completes before a node is killed (snapshots every
step start after the first: the first optimizer step makes the optimizer's state)."""

FSDP2 = Example(
    name="fsdp2",
    script=EXAMPLES / "fsdp2" / "train.py",
    args=("--steps", str(STEPS)),
    global_batch=32,  # upstream's
    summed=True,  # upstream's loss: model(x).sum()
)
HF_LLAMA = Example(
    name="hf_llama",
    script=EXAMPLES / "hf_llama" / "train.py",
    args=(
        "--steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2",
        "--seq-len", "32", "--vocab", "32", "--hidden", "64", "--layers", "2", "--lr", "3e-3",
    ),  # fmt: skip
    global_batch=8,
)
MINGPT = Example(
    name="mingpt",
    script=EXAMPLES / "mingpt" / "main.py",
    # Hydra overrides of upstream's gpt2_train_cfg.yaml: a tiny GPT on the first 74% of a
    # text at hand (upstream's licence), 20 steps of 48 samples an epoch, two epochs (the
    # run crosses an epoch, its upstream snapshot and its evaluation pass), AMP and a
    # DataLoader worker on. The attention's own dropout (nn.MultiheadAttention's) is off:
    # it draws from the rank's RNG; the model's other dropouts are keyed by sample.
    args=(
        f"data_config.path={EXAMPLES / 'mingpt' / 'upstream' / 'LICENSE'}", "data_config.truncate=0.74",
        "data_config.block_size=16", "gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=32",
        "+gpt_config.attn_pdrop=0", "trainer_config.batch_size=48", "trainer_config.max_epochs=2",
        "trainer_config.data_loader_workers=1", "trainer_config.use_amp=true",
    ),  # fmt: skip
    global_batch=48,
    steps=STEPS,
)


@pytest.fixture(params=[FSDP2, HF_LLAMA, MINGPT], ids=lambda e: e.name)
def example(request: pytest.FixtureRequest) -> Example:
    return request.param  # type: ignore[no-any-return]


class StraightRuns(dict[str, StraightRun]):
    """The uninterrupted run of each example by name, in folders under ``root``."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root


@pytest.fixture(scope="module")
def straight_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[StraightRuns]:  # fmt: skip
    """The uninterrupted run of each example, by name. Its script and arguments are the same
    in every test of the example, so those tests compare with one run."""
    with scratch(request, tmp_path_factory, "straight") as root:
        runs = StraightRuns(root)
        try:
            yield runs
        finally:
            for running in runs.values():
                running.close()


@pytest.fixture
def straight(
    straight_runs: StraightRuns, worker_env: dict[str, str], example: Example,
) -> StraightRun:  # fmt: skip
    """The uninterrupted run on 2 ranks, started first (by the first test of its example):
    it trains while the job waits."""
    if example.name not in straight_runs:
        root = straight_runs.root / example.name
        root.mkdir()
        straight_runs[example.name] = StraightRun(example, 2, root, worker_env)
    return straight_runs[example.name]


@pytest.fixture
def job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str], example: Example) -> Iterator[ScriptJob]:
    running = ScriptJob(etcd.endpoint, tmp_path / "job", worker_env, example=example)
    try:
        yield running
    finally:
        running.close()


def _all_ranks_reached(folder: Path, size: int, step: int) -> bool:
    return any(w.world_size == size and w.complete(step) for w in worlds(folder))


@pytest.mark.timeout(600)
def test_a_loss_a_grow_and_a_planned_shrink_follow_the_uninterrupted_run(
    example: Example, straight: StraightRun, job: ScriptJob
) -> None:
    samples = job.root / "samples"
    job.expect(0, ["a", "b"], "start")  # the first world holds both, like the run compared with
    for node in ("a", "b"):
        job.start(node)
    wait_for(lambda: _all_ranks_reached(samples, 2, KILL_AFTER), 180, f"2 ranks past step {KILL_AFTER}")
    pids = {node: job.workers(node) for node in ("a", "b")}
    assert all(len(p) == 1 for p in pids.values()), pids
    watch = job.watch_workers(["a"])  # the survivor keeps its process throughout

    # A node lost without notice: the survivor rebuilds from the snapshots, in place. The
    # world it forms trains one step, then answers the checkpoint request and holds.
    job.kill_node("b")
    job.ask_checkpoint(1)
    lost = job.await_progress(
        "1 rank training after the loss", lambda p: p.world_size == 1 and p.step > p.resumed_from_step, timeout=120
    )
    reached = max(steps_done(samples, 2))
    assert lost.reform_mode == "in-place"
    assert "reshard" in lost.resume_phases and "load" not in lost.resume_phases, lost.resume_phases
    assert lost.resumed_from_step >= reached - 1, f"reached {reached}, resumed from {lost.resumed_from_step}"

    # The controller takes over; b comes back and the job grows to 2 at the held boundary.
    job.claim_control()
    ack = job.acked(1)
    job.start("b")
    wait_for(lambda: "b" in job.members(), 120, "b registering as a joiner")
    job.ask_checkpoint(2)
    job.reform(1, ["a", "b"], cause="grow")
    grown = job.await_progress("2 ranks training", lambda p: p.world_size == 2 and p.step > ack.step)
    assert (grown.resumed_from_step, grown.reform_mode) == (ack.step, "in-place")

    # A planned shrink (a reclaim notice on b's node): checkpoint with hold, ack, re-form.
    ack = job.acked(2)
    assert ack.step < STEPS, "the run must still have steps to train after the shrink"
    job.reform(2, ["a"], cause="reclaim")
    assert job.procs["a"].wait(240) == 0, job.log("a")[-3000:]
    # b, left out of the round, waited to be let back in (it never reported success) and
    # ends with the job: its rendezvous closed, the run is over for every node.
    assert job.events("b", LEFT_OUT), job.log("b")[-3000:]
    assert job.procs["b"].wait(60) == 0, job.log("b")[-3000:]
    assert watch.close() == {"a": set(pids["a"])}, "the survivor's worker was restarted"
    shrunk = job.progress()
    assert shrunk is not None and (shrunk.step, shrunk.world_size) == (STEPS, 1)
    assert (shrunk.resumed_from_step, shrunk.reform_mode) == (ack.step, "in-place")  # 0 steps lost
    assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
    got = trained(samples, STEPS, example.global_batch, example.summed)

    expected = trained(straight.wait(), STEPS, example.global_batch, example.summed)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), f"loss differs at step {step}"
    assert expected[STEPS] < expected[1] - 0.1, "the model should learn, or the comparison means little"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", [FSDP2], ids=lambda e: e.name, indirect=True)
def test_a_spare_takes_a_lost_nodes_place_in_a_users_script(
    example: Example, straight: StraightRun, job: ScriptJob
) -> None:
    """The user's script gets spares as the built-in trainer does: with c waiting beyond
    max, b's loss is answered by c in b's place at the same world size, from the snapshots'
    buddy copies, losing at most one step, and the kept history is the uninterrupted run's."""
    samples = job.root / "samples"
    job.claim_control()
    job.ask_checkpoint(1)  # the first world trains one step, acks and holds until c is up
    job.expect(0, ["a", "b"], "start")
    for node in ("a", "b"):
        job.start(node, nnodes="1:2")
    ack = job.acked(1)
    job.start("c", nnodes="1:2")
    job.await_joiner("c", after=0)
    pids = {node: job.workers(node) for node in ("a", "c")}
    assert all(len(p) == 1 for p in pids.values()), pids
    watch = job.watch_workers(["a", "c"])
    job.reform(1, ["a", "b"], cause="manual")  # c is a spare: not in the round, still waiting
    wait_for(lambda: _all_ranks_reached(samples, 2, ack.step + KILL_AFTER), 180, "2 ranks training on")

    job.kill_node("b")
    replaced = job.await_progress(
        "2 ranks training after the loss", lambda p: p.world_size == 2 and p.step > p.resumed_from_step + 1,
        timeout=120,
    )
    assert replaced.reform_mode == "in-place"
    assert "reshard" in replaced.resume_phases and "load" not in replaced.resume_phases, replaced.resume_phases
    assert replaced.last_step - replaced.resumed_from_step <= 1, replaced
    for node in ("a", "c"):
        assert job.procs[node].wait(240) == 0, job.log(node)[-3000:]
    assert watch.close() == {n: set(p) for n, p in pids.items()}, "a worker was restarted"
    [moved] = job.events("c", "resharded in memory")[-1:]
    assert moved["layout"] == "same" and moved["received_bytes"] > 0
    assert job.events("a", "resharded in memory")[-1]["received_bytes"] == 0
    got = trained(samples, STEPS, example.global_batch, example.summed)
    expected = trained(straight.wait(), STEPS, example.global_batch, example.summed)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), f"loss differs at step {step}"
