"""A re-form reaches ``in_place`` through the wrappers scripts are written with
(``@hydra.main`` above and below it, click, typer, ``fire``) and through the script's own
``except Exception``.

End to end: one job of real ``regroup-run`` agents on a real etcd, two nodes of three
ranks, each rank a different variant of tests/elastic/wrapper_script.py, re-formed once as
the controller plans it and once for a node lost without notice. Every variant re-forms in
place: the same process in every world, no step lost on the planned re-form.

Each way a call can end, through each real wrapper, against a world whose re-form is due or
not (its agent's ``world.json`` written here): what ``in_place`` makes of what reaches it
(``reform_cause``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from regroup.demo.etcd_server import EtcdServer
from regroup.rendezvous.inplace.channel import CHANNEL_ENV, WORLD_FILE, NodeWorld, write_atomically
from regroup.rendezvous.inplace.membership import LeavingJob, Membership, Reform
from regroup.rendezvous.inplace.world import ElasticWorld
from regroup.elastic.session import reform_cause
from tests.rendezvous.inplace_job import InPlaceJob

SCRIPT = Path(__file__).with_name("wrapper_script.py")
VARIANTS = {"a": ["hydra-above", "except", "fire"], "b": ["hydra-below", "click", "typer"]}
"""Node -> the variant of each of its three local ranks. The node lost in the test is b: a keeps
the variants whose path differs when a collective fails in the script (Hydra exits 1 on the
error, the script's ``except Exception`` swallows it)."""


class WrapperJob(InPlaceJob):
    """``InPlaceJob`` whose nodes run three ranks of the wrapper script each."""

    nnodes = "1:2"
    nproc_per_node = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.root / "conf"
        config.mkdir()
        run_dir = str(self.root / "hydra" / "${oc.env:NODE_NAME}-${oc.env:LOCAL_RANK}")
        hydra = {"run": {"dir": run_dir}, "output_subdir": None, "job": {"chdir": False}}
        (config / "train.yaml").write_text(yaml.safe_dump({"steps": 100_000, "hydra": hydra}))
        self.env = {
            **self.env,
            "REGROUP_ETCD_ENDPOINT": self.endpoint,
            "REGROUP_CHECKPOINT_DIR": str(self.root / "ckpt"),
            "WRAPPER_VARIANTS": ";".join(f"{node}={','.join(names)}" for node, names in VARIANTS.items()),
            "WRAPPER_CONFIG_DIR": str(config),
        }

    def worker(self) -> list[str]:
        return [str(SCRIPT)]

    def worlds(self, node: str) -> dict[str, list[dict[str, Any]]]:
        """Variant -> the worlds its rank trained in (one line per call of its function)."""
        found: dict[str, list[dict[str, Any]]] = {}
        for line in self.log(node).splitlines():
            if line.startswith('{"world"'):
                world = json.loads(line)["world"]
                found.setdefault(world["variant"], []).append(world)
        return found


@pytest.fixture
def wrapper_job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[WrapperJob]:
    job = WrapperJob(etcd.endpoint, tmp_path / "job", worker_env)
    try:
        yield job
    finally:
        job.close()


def same_process(job: WrapperJob, nodes: list[str], calls: int) -> None:
    """Every variant of ``nodes`` trained in ``calls`` worlds, all in one process."""
    for node in nodes:
        worlds = job.worlds(node)
        for variant in VARIANTS[node]:
            seen = worlds.get(variant, [])
            assert len(seen) == calls, f"{variant} on {node}: {seen}\n{job.log(node)[-4000:]}"
            assert len({w["pid"] for w in seen}) == 1, f"{variant} on {node} was restarted: {seen}"
        assert not job.events(node, "worker group failed; restarting it"), job.log(node)[-4000:]


@pytest.mark.slow
def test_a_reform_reaches_in_place_through_wrappers_and_except_exception(wrapper_job: WrapperJob) -> None:
    job = wrapper_job
    job.expect(0, ["a", "b"], "start")
    for node in VARIANTS:
        job.start(node)
    job.await_progress("6 ranks training", lambda p: p.world_size == 6 and p.step >= 2, timeout=120)

    # Planned, as the controller plans it: the state held at one boundary, then the re-form.
    job.claim_control()
    ack = job.checkpoint(1)
    job.reform(1, ["a", "b"])
    planned = job.await_progress(
        "6 ranks after the planned re-form", lambda p: p.world_size == 6 and p.resumed_from_step == ack.step > 0
    )
    assert planned.reform_mode == "in-place", planned
    assert planned.last_step == ack.step, f"{planned.last_step - ack.step} steps lost: {planned}"
    same_process(job, ["a", "b"], calls=2)
    assert {w[-1]["step"] for node in VARIANTS for w in job.worlds(node).values()} == {ack.step}

    # Lost without notice: the survivors' collectives fail inside the script (DDP's backward)
    # or at the step boundary, and reach in_place through Hydra and the script's except.
    job.kill_node("b")
    lost = job.await_progress("3 ranks after b's loss", lambda p: p.world_size == 3 and p.step > p.resumed_from_step)
    assert lost.reform_mode == "in-place", lost
    same_process(job, ["a"], calls=3)


# -- what in_place makes of what reaches it --------------------------------------------------

PEER_LOST = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.3.7]:47120"


def forced_world(channel: Path, reform_due: bool) -> ElasticWorld:
    """A worker's world in round 1 under an agent whose channel is ``channel``; with
    ``reform_due``, the agent has announced the re-form that ends it."""
    world = ElasticWorld({CHANNEL_ENV: str(channel)}, "gloo", timedelta(minutes=1), timedelta(seconds=1), ())
    world.membership = Membership(round=1, rank=0, world_size=2, local_rank=0, master_addr="", master_port=0, seq=1)
    if reform_due:
        announced = NodeWorld(seq=2, round=1, pending=True, master_addr="", master_port=0, group_rank=-1,
                              group_world_size=-1, reason="membership changed")  # fmt: skip
        write_atomically(channel / WORLD_FILE, announced.to_json())
    return world


def hydra_config(folder: Path) -> Path:
    """A Hydra config that leaves the process's logging and working directory alone."""
    folder.mkdir()
    defaults = [{"override hydra/job_logging": "none"}, {"override hydra/hydra_logging": "none"}, "_self_"]
    hydra = {"run": {"dir": str(folder / "run")}, "output_subdir": None, "job": {"chdir": False}}
    (folder / "train.yaml").write_text(yaml.safe_dump({"defaults": defaults, "hydra": hydra}))
    return folder


def run_under(wrapper: str, body: Callable[[], None], config: Path) -> BaseException | None:
    """Call ``body`` through ``wrapper`` as a script's ``main()`` would be called, and
    return what reaches the caller above it (None: a return)."""
    try:
        if wrapper == "hydra":
            import hydra

            hydra.main(config_path=str(config), config_name="train", version_base=None)(lambda cfg: body())()
        elif wrapper == "click":
            import click

            click.command()(body).main(args=[], standalone_mode=True)
        elif wrapper == "typer":
            import typer

            typer.run(body)
        elif wrapper == "fire":
            import fire

            fire.Fire(body, command=[])
        elif wrapper == "except":
            try:
                body()
            except Exception as swallowed:  # what a script that catches everything does
                del swallowed
        else:
            body()
    except BaseException as exc:
        return exc
    return None


def script(case: str, exc: BaseException | None) -> Callable[[], None]:
    """The training function of ``case``: it raises ``exc`` (None: it returns); for
    ``caught-and-exited`` it catches everything, the re-form included, and exits 1."""

    def body() -> None:
        if exc is None:
            return
        if case != "caught-and-exited":
            raise exc
        try:
            raise exc
        except BaseException:
            sys.exit(1)

    return body


CASES = {
    # case: (what the call raises, a re-form announced, the run's state, whether it re-forms)
    # The run's Reform at an agreed boundary is a BaseException: every wrapper lets it through.
    "boundary": (lambda: Reform("re-form at this step boundary"), False, "training", True),
    # Caught anyway and turned into an exit: the run said so (``ended``); the chain holds it.
    "caught-and-exited": (lambda: Reform("re-form at this step boundary"), False, "training", True),
    # A collective in the step failed on a lost peer: Hydra exits 1 on it, the others let it
    # through. Swallowed, it is known only once the world says so (the next boundary, tested
    # end to end above).
    "peer-lost": (lambda: RuntimeError(PEER_LOST), False, "training", "all but except"),
    # The groups were aborted for an announced re-form: swallowed and returned, still one.
    "aborted": (lambda: RuntimeError("Connection reset by peer"), True, "training", True),
    # The script's own error while nothing is re-formed: never a re-form.
    "error": (lambda: ValueError("bad batch"), False, "training", False),
    # A finished run (click and typer exit 0 after it), even as a re-form is announced.
    "finished": (lambda: None, True, "finished", False),
}


@pytest.mark.parametrize("wrapper", ["bare", "hydra", "click", "typer", "fire", "except"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_reform_is_recognised_whatever_a_wrapper_or_except_made_of_it(
    tmp_path: Path, wrapper: str, case: str
) -> None:
    make, due, run_state, reforms = CASES[case]
    exc = make()
    ended = exc if isinstance(exc, Reform) else None  # the run tells the session what it raised
    world = forced_world(tmp_path, due)
    hook = sys.excepthook  # typer installs its own
    argv, sys.argv = sys.argv, [str(tmp_path / "train.py")]  # what the wrappers parse
    try:
        arrived = run_under(wrapper, script(case, exc), hydra_config(tmp_path / "conf"))
    finally:
        sys.argv, sys.excepthook = argv, hook
    cause = reform_cause(arrived, world, ended, run_state)
    expected = reforms if isinstance(reforms, bool) else wrapper != "except"
    assert (cause is not None) == expected, f"{case} under {wrapper}: {arrived!r} -> {cause!r}"
    if isinstance(exc, Reform):
        assert cause is exc and exc.clean
    if case == "aborted" and wrapper == "except":
        assert isinstance(cause, Reform) and not cause.clean  # returned: only the snapshots are consistent


def test_a_leave_a_keyboard_interrupt_and_a_world_outside_regroup_run_never_reform(tmp_path: Path) -> None:
    world = forced_world(tmp_path, reform_due=True)
    assert reform_cause(LeavingJob(), world, None, "training") is None
    assert reform_cause(KeyboardInterrupt(), world, None, "training") is None
    torchrun = ElasticWorld({}, "gloo", timedelta(minutes=1), timedelta(seconds=1), ())  # no agent's channel
    assert reform_cause(RuntimeError(PEER_LOST), torchrun, None, "training") is None
