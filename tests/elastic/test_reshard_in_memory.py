"""Growing the world in memory: survivors send their FSDP2 shards over the new process
group and the grown world lands on the new sharding without reading a checkpoint.

Three real processes on gloo (``reshard_memory_worker``): a world of 2 trains two steps,
holds its shards, then a world of 3 (the two survivors and a newcomer) redistributes them;
finally a world of 2 that lacks old rank 1 must refuse. Widths do not divide by 3 (most
not by 2), so the old and new chunks are uneven. Both scenarios (survivors keep their
ranks, survivors permuted) run one after the other in the same three processes, so the
second also covers processes that change rank between worlds of the same shape.

A replacement at the same size runs in four more processes (``reshard_replace_worker``):
old rank 2's shards exist only as a copy on rank 0, a fresh process takes position 2,
and only it receives, point to point, in many small messages.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from regroup.elastic.memory.reshard import CHUNK, NONE, WHOLE, Choice, can_redistribute, choose
from tests.elastic.harness import run_all
from tests.scratch import scratch

REPO = Path(__file__).resolve().parents[2]


SCENARIOS = {"survivors-keep-ranks": [0, 1, 2], "survivors-permuted": [2, 0, 1]}
"""Name -> the new rank of each process (0 and 1 held old ranks 0 and 1; 2 is the newcomer)."""


REPLACE_BUCKET_BYTES = 4096
"""A few tensors' shards per message: a replacement receives its shards in many messages."""


def _run_workers(out: Path, timeout: float = 180) -> None:
    spec = {"scenarios": SCENARIOS}
    _run(out, "tests.elastic.reshard_memory_worker", 3, spec, timeout)


def _run(out: Path, worker: str, procs: int, spec: dict[str, Any], timeout: float) -> None:
    # The test hosts the store on a port the kernel picked: no port is guessed.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    argv = [sys.executable, "-m", worker, json.dumps({"port": store.port, "out": str(out), **spec})]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    logs = [out / f"proc-{p}.log" for p in range(procs)]
    run_all([[*argv, str(p)] for p in range(procs)], logs, env, REPO, timeout)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One run of the three processes through every scenario (they import torch once)."""
    with scratch(request, tmp_path_factory, "reshard-in-memory") as out:
        _run_workers(out)
        yield out


@pytest.fixture(params=sorted(SCENARIOS))
def grown(request: pytest.FixtureRequest, runs: Path) -> Path:
    """The folder of one scenario."""
    return runs / request.param


def _assert_identical(left: Any, right: Any, where: str = "") -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and torch.equal(left, right), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and sorted(left) == sorted(right), where
        for key in left:
            _assert_identical(left[key], right[key], f"{where}/{key}")
    elif isinstance(left, list | tuple):
        assert isinstance(right, list | tuple) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            _assert_identical(a, b, f"{where}[{index}]")
    else:
        assert left == right, where


def _results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"proc-{p}.json").read_text()) for p in range(3)]


def test_can_redistribute_needs_every_old_rank_at_one_step() -> None:
    assert can_redistribute([(0, 2, 5), (1, 2, 5), None])
    assert can_redistribute([None, (1, 2, 5), (0, 2, 5)])
    assert can_redistribute([(0, 1, 5), None, None])
    assert can_redistribute([(0, 2, 5), (1, 2, 5), (1, 2, 5)]), "old rank 1 twice: one copy is used"
    assert not can_redistribute([(0, 2, 5), None, None]), "old rank 1 is missing"
    assert not can_redistribute([(0, 2, 5), (0, 2, 5), None]), "old rank 0 twice, 1 missing"
    assert not can_redistribute([(0, 2, 5), (1, 2, 6), None]), "no step holds both"
    assert not can_redistribute([(0, 2, 5), (1, 3, 5), None]), "old world sizes disagree"
    assert not can_redistribute([None, None]), "nobody holds state"


def test_the_newest_step_held_whole_is_chosen_from_snapshots_and_buddy_copies() -> None:
    # Old world of 3, old rank 2 lost without notice. The survivors hold their own snapshots
    # of steps 7 and 8; old rank 2's copies are on its buddies, 7 on new rank 0, 8 on new rank 1.
    held = [
        [(0, 3, 7, CHUNK), (0, 3, 8, CHUNK), (2, 3, 7, CHUNK)],  # old rank 0 at 7 and 8, old rank 2's copy at 7
        [(1, 3, 7, CHUNK), (1, 3, 8, CHUNK), (2, 3, 8, CHUNK)],  # old rank 1 at 7 and 8, old rank 2's copy at 8
    ]
    choice = choose(held)
    assert isinstance(choice, Choice) and choice.step == 8
    assert choice.sources == {0: (0, 1), 1: (1, 1), 2: (1, 2)}
    assert choice.chunks == choice.sources and choice.whole == [], "snapshots hold the replicated state in chunks"
    # Old rank 2's copy of step 8 never arrived: step 7 is the newest held whole.
    earlier = choose([held[0], held[1][:2]])
    assert isinstance(earlier, Choice) and earlier.step == 7
    assert earlier.sources == {0: (0, 0), 1: (1, 0), 2: (0, 2)}
    assert "no step" in str(choose([[(0, 3, 7, CHUNK)], [(1, 3, 8, CHUNK)]]))


def test_shards_a_leaving_rank_handed_over_need_a_survivor_holding_the_replicated_state_whole() -> None:
    handed = [[(1, 2, 5, NONE)], [(0, 2, 5, NONE)]]  # each holds only the other's shards
    assert "no step" in str(choose(handed))
    choice = choose([[(0, 2, 5, WHOLE), (1, 2, 5, NONE)], None])
    assert isinstance(choice, Choice) and choice.whole == [(0, 0)] and choice.sources == {0: (0, 0), 1: (0, 1)}
    # A state with no sharded entries (DDP) needs only the replicated entries, from anyone.
    assert isinstance(choose([[(2, 4, 5, WHOLE)], None], sharded=False), Choice)
    assert not isinstance(choose([[(2, 4, 5, CHUNK)], None], sharded=False), Choice), "one chunk of four"


def test_a_leaving_rank_hands_over_exactly_what_it_held(grown: Path) -> None:
    handed, donor = torch.load(grown / "handed.pt"), torch.load(grown / "donor.pt")
    assert donor["tensors"] and len(donor["sharded"]) > 10, "a whole model's and optimizer's shards"
    assert set(donor["tensors"]) > set(donor["sharded"]), "AdamW's step entries are replicated"
    # The keeper holds the replicated entries itself, at the same step: only shards travel.
    assert (donor["replicated"], handed["replicated"]) == ("whole", "none")
    donor["tensors"] = {k: v for k, v in donor["tensors"].items() if k in donor["sharded"]}
    donor["replicated"] = "none"
    _assert_identical(handed, donor, "hand-off")


def test_grow_lands_on_the_exact_old_state_without_a_checkpoint(grown: Path) -> None:
    old = torch.load(grown / "old.pt")
    new = torch.load(grown / "grown.pt")
    assert any(t.shape[0] % 3 for t in old["model"].values()), "some old and new chunks must be uneven"
    assert old["optim"]["state"], "the old world must have optimizer state to carry"
    _assert_identical(new["model"], old["model"], "model")
    _assert_identical(new["optim"], old["optim"], "optim")
    assert {g["lr"] for g in new["optim"]["param_groups"]} == {3e-3}
    assert [r["step"] for r in _results(grown)] == [2, 2, 2]


def test_grown_world_steps_like_one_that_loaded_the_full_state(grown: Path) -> None:
    results = _results(grown)
    assert {r["grown_loss"] for r in results} == {results[0]["reference_loss"]}
    _assert_identical(torch.load(grown / "grown-after.pt"), torch.load(grown / "reference-after.pt"))
    before, after = torch.load(grown / "grown.pt")["model"], torch.load(grown / "grown-after.pt")["model"]
    assert any(not torch.equal(after[k], before[k]) for k in after), "the step must change the model"


def test_shrink_refuses_on_every_rank_instead_of_hanging(grown: Path) -> None:
    results = _results(grown)
    errors = [r.get("shrink_error") for r in results]
    assert errors[1] is None, "old rank 1 stays out of the shrunk world"
    assert errors[0] is not None and errors[0] == errors[2]
    assert "no step at which the old ranks 0..1 are all held" in errors[0]


# --- a replacement at the same size -----------------------------------------------------


@pytest.fixture(scope="module")
def replaced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One run of the four processes of ``reshard_replace_worker``."""
    with scratch(request, tmp_path_factory, "reshard-replace") as out:
        _run(out, "tests.elastic.reshard_replace_worker", 4, {"bucket_bytes": REPLACE_BUCKET_BYTES}, 240)
        yield out


def _replace_results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"proc-{p}.json").read_text()) for p in range(4)]


def test_a_replacement_at_the_same_size_lands_every_rank_on_its_own_old_shards(replaced: Path) -> None:
    results = _replace_results(replaced)
    assert [r["held"] for r in results] == [[[0, 2], [2, 2], [1, 2]], [[1, 2]], [], [[3, 2]]]
    assert [r["replace"]["step"] for r in results] == [2, 2, 2, 2]
    old = torch.load(replaced / "old.pt")
    assert old["optim"]["state"], "the old world must have optimizer state to carry"
    assert any(t.shape[0] % 4 for t in old["model"].values()), "some shards must be uneven"
    for rank in range(4):
        rebuilt, original = torch.load(replaced / f"replace-{rank}.pt"), torch.load(replaced / f"old-{rank}.pt")
        _assert_identical(rebuilt, original, f"rank {rank}")
    new = torch.load(replaced / "replace.pt")
    _assert_identical(new["model"], old["model"], "model")
    _assert_identical(new["optim"], old["optim"], "optim")
    assert {g["lr"] for g in new["optim"]["param_groups"]} == {3e-3}


def test_only_the_replaced_position_receives_and_only_its_shards(replaced: Path) -> None:
    moved = [r["replace"] for r in _replace_results(replaced)]
    assert {m["layout"] for m in moved} == {"same"}
    lost = torch.load(replaced / "old-2.pt")
    nbytes = {k: v.numel() * v.element_size() for k, v in lost["tensors"].items()}
    lost_bytes = sum(nbytes[k] for k in lost["sharded"])
    replicated_bytes = sum(n for k, n in nbytes.items() if k not in lost["sharded"])
    assert lost_bytes > 4 * REPLACE_BUCKET_BYTES, "the shards must take several messages"
    assert replicated_bytes > 0, "AdamW's step entries are replicated"
    assert [m["received_bytes"] for m in moved] == [0, 0, lost_bytes + replicated_bytes, 0]
    # Rank 0 holds old rank 1 too, and is its lowest holder, yet rank 1 keeps its own:
    # rank 0 sends old rank 2's shards and nothing else; the replicated entries come as
    # tensors from one survivor that holds them whole.
    assert [m["sent_bytes"] for m in moved] == [lost_bytes, 0, 0, replicated_bytes]
    held = [[(0, 4, 2), (2, 4, 2), (1, 4, 2)], [(1, 4, 2)], None, [(3, 4, 2)]]
    choice = choose(held)  # type: ignore[arg-type]
    assert isinstance(choice, Choice) and choice.sources[1] == (0, 2)


def test_taking_every_piece_from_its_chosen_holder_rebuilds_the_same_world_identically(replaced: Path) -> None:
    for rank in range(4):
        _assert_identical(
            torch.load(replaced / f"remote-{rank}.pt"), torch.load(replaced / f"replace-{rank}.pt"), f"{rank}"
        )
    _assert_identical(torch.load(replaced / "remote.pt"), torch.load(replaced / "replace.pt"))
    remote = [r["remote"] for r in _replace_results(replaced)]
    own = [r["replace"] for r in _replace_results(replaced)]
    assert [r["remote"]["step"] for r in _replace_results(replaced)] == [2, 2, 2, 2]
    # Old rank 1's lowest holder is rank 0: rank 1 receives its own shards from it.
    assert remote[1]["received_bytes"] > 0 == own[1]["received_bytes"]
    assert sum(m["received_bytes"] for m in remote) > sum(m["received_bytes"] for m in own)
