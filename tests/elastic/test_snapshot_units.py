"""The pure parts of in-memory snapshots: buddy placement, buffer layout, the memory check,
the settings and the interval ``every: auto`` chooses (from costs passed in)."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from regroup.elastic.settings import ConfigError
from regroup.trainer.config_loading import config_from_dict
from regroup.elastic.world.runtime import Runtime, init_runtime
from regroup.trainer.sharding import build_sharded_model
from regroup.elastic.options import options
from regroup.elastic.memory.reshard import HeldState
from regroup.elastic.memory.snapshot import Snapshots
from regroup.elastic.memory.snapshot_cost import (
    QUIET_STEPS,
    CostMeter,
    SnapshotMemoryError,
    check_host_memory,
    share_bytes,
    state_bytes,
    host_memory_available,
    interval_for,
)
from regroup.elastic.memory.snapshot_layout import Layout, buddies, layout_for
from regroup.elastic.memory.handoff import plan_securing, securing_load


def _is_rotation(buddy: list[int]) -> bool:
    return sorted(buddy) == list(range(len(buddy))) and all(b != r for r, b in enumerate(buddy))


def test_every_buddy_is_on_another_node() -> None:
    places = [("", "a"), ("", "a"), ("", "b"), ("", "b"), ("", "c"), ("", "c")]  # two ranks per node
    buddy = buddies(places)
    assert _is_rotation(buddy)
    assert all(places[r][1] != places[b][1] for r, b in enumerate(buddy))


def test_buddies_prefer_another_failure_domain_when_the_ranks_say_which() -> None:
    places = [("zone-1", "a"), ("zone-1", "b"), ("zone-2", "c"), ("zone-2", "d")]
    buddy = buddies(places)
    assert _is_rotation(buddy)
    assert all(places[r][0] != places[b][0] for r, b in enumerate(buddy)), buddy


def test_a_node_with_more_ranks_than_the_rest_still_sends_off_node_where_it_can() -> None:
    places = [("", "a")] * 3 + [("", "b")] * 3 + [("", "c")]
    buddy = buddies(places)
    assert _is_rotation(buddy)
    assert all(places[r] != places[b] for r, b in enumerate(buddy))


def test_one_node_pairs_ranks_on_it() -> None:
    assert buddies([("", "a"), ("", "a")]) == [1, 0]


def test_leaving_ranks_secure_every_state_on_two_staying_ranks_within_the_stated_load() -> None:
    """Before a planned shrink's ack, whatever the nodes that leave: every old rank's snapshot
    ends up on ``min(2, staying)`` staying ranks, each move sends what its donor holds (its
    own or its sender's copy) to a rank that does not hold it yet, and no keeper receives
    more than ``securing_load`` shares."""
    rng = random.Random(5)
    for _ in range(3000):
        n, per_node = rng.randint(2, 24), rng.choice([1, 2, 4, 8])
        places = [("zone", f"n{r // per_node}") for r in range(n)]
        buddy = buddies(places)
        sender = {b: r for r, b in enumerate(buddy)}
        nodes = sorted({node for _, node in places})
        gone = set(rng.sample(nodes, rng.randint(1, len(nodes))))
        leaving = [node in gone for _, node in places]
        staying = n - sum(leaving)
        holders = {r: {h for h in (r, buddy[r]) if not leaving[h]} for r in range(n)}
        moves = plan_securing(leaving, buddy)
        for donor, owner, keeper in moves:
            assert leaving[donor] and not leaving[keeper] and owner in (donor, sender[donor])
            assert keeper not in holders[owner]
            holders[owner].add(keeper)
        assert all(len(h) >= min(2, staying) for h in holders.values())
        loads = Counter(keeper for _, _, keeper in moves)
        assert max(loads.values(), default=0) <= securing_load(sum(leaving), staying)
    # One rank leaving two or more staying: its snapshot and its sender's copy, one share each to two keepers.
    assert sorted(k for _, _, k in plan_securing([False, False, True, False], [1, 2, 3, 0])) == [0, 3]
    assert securing_load(1, 3) == 2 and securing_load(0, 3) == 0
    # Two staying ranks that hold the leaving rank's and its sender's copies already: nothing moves.
    assert plan_securing([False, True], [1, 0]) == []


def test_a_rank_layout_is_derived_from_any_rank_state() -> None:
    # Rows 5 over 4 ranks (torch.chunk: 2, 2, 1, 0). Replicated entries (a bias of 6, AdamW's
    # scalar step) are split flat over the ranks: 2, 2, 2, 0 and 1, 0, 0, 0.
    shapes = {"model/b": (6,), "model/w": (5, 3), "optim/state.w.step": ()}
    template = HeldState(
        0, 4, 1, {"model/b": torch.zeros(6), "model/w": torch.zeros(2, 3), "optim/state.w.step": torch.zeros(())},
        frozenset({"model/w"}), shapes, {},
    )  # fmt: skip
    layouts = [{e.key: e.shape for e in layout_for(template, r, 4).entries} for r in range(4)]
    assert [shape["model/w"] for shape in layouts] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    assert [shape["model/b"] for shape in layouts] == [(2,), (2,), (2,), (0,)]
    assert [shape["optim/state.w.step"] for shape in layouts] == [(1,), (0,), (0,), (0,)]
    layout = layout_for(template, 0, 4)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    views["model/w"].fill_(1.5)
    views["optim/state.w.step"].fill_(7)
    layout.stamp(buffer).copy_(torch.tensor([3, 0]))
    again = layout.views(buffer)
    assert torch.equal(again["model/w"], torch.full((2, 3), 1.5)) and again["optim/state.w.step"].item() == 7
    assert layout.stamp(buffer).tolist() == [3, 0]
    assert all(e.offset % 16 == 0 for e in layout.entries)
    assert Layout.of([("x", (3,), torch.float32)]).nbytes == 32  # 12 bytes aligned to 16, then the stamp


def test_the_trainer_refuses_snapshots_and_a_re_form_host_memory_cannot_hold() -> None:
    check_host_memory(1 << 30, 512 << 20, 4, 8 << 30)  # 6 GiB of 8: fine
    pattern = (
        r"snapshot.every: .*need 1.00 GiB .*per rank \(4x its share of the job's state\) and an in-place re-form "
        r"1.00 GiB more .*4 on this node: 8.00 GiB.*snapshot.every: 0"
    )
    with pytest.raises(SnapshotMemoryError, match=pattern):
        check_host_memory(1 << 30, 1 << 30, 4, 8 << 30)
    assert isinstance(SnapshotMemoryError("x"), ConfigError), "the trainer exits with a configuration error"


def test_a_snapshot_keeps_its_share_of_replicated_state_not_all_of_it() -> None:
    model = torch.nn.Linear(100, 10)  # 1010 parameters, replicated (DDP or one rank): 4040 bytes
    assert state_bytes(model) == 3 * 4040, "parameters and AdamW's two moments"
    assert share_bytes(model, 4) == 3 * 1010, "a quarter of it on each of four ranks"
    assert share_bytes(model, 1) == state_bytes(model)


def test_host_memory_is_capped_by_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   8388608 kB\n")  # 8 GiB
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory_available(meminfo, cgroup) == 8 << 30, "no limit readable: the node's figure"
    (cgroup / "memory.max").write_text(f"{3 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert host_memory_available(meminfo, cgroup) == 2 << 30
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory_available(meminfo, cgroup) == 8 << 30


def test_snapshot_interval_setting() -> None:
    assert config_from_dict({}).snapshot.interval is None, "auto by default"
    assert config_from_dict({"snapshot": {"every": 0}}).snapshot.interval == 0
    assert config_from_dict({"snapshot": {"every": 1}}).snapshot.interval == 1
    assert config_from_dict({"snapshot": {"every": 5, "max_every": 5}}).snapshot.interval == 5
    with pytest.raises(ConfigError, match="snapshot.every: must be >= 0 or auto"):
        config_from_dict({"snapshot": {"every": -1}})
    with pytest.raises(ConfigError, match="snapshot.every: expected an integer, got 'sometimes' or must be one of"):
        config_from_dict({"snapshot": {"every": "sometimes"}})


def test_a_node_lost_without_notice_costs_at_most_one_step_unless_max_every_says_more() -> None:
    assert config_from_dict({}).snapshot.max_every == 1
    assert config_from_dict({"snapshot": {"max_every": 8}}).snapshot.max_every == 8
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=r"^snapshot.max_every: must be >= 1$"):
            config_from_dict({"snapshot": {"max_every": bad}})
    with pytest.raises(ConfigError, match="snapshot.max_every: expected an integer, got 'auto'"):
        config_from_dict({"snapshot": {"max_every": "auto"}})


def test_an_explicit_interval_wider_than_max_every_is_refused_naming_both_fields() -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"snapshot": {"every": 5}})
    message = str(refused.value)
    assert message.startswith("snapshot.every: 5 is more than snapshot.max_every=1"), message
    assert "set snapshot.max_every: 5" in message, "says how to accept the wider bound"
    with pytest.raises(ConfigError, match="snapshot.every: 5 is more than snapshot.max_every=4"):
        config_from_dict({"snapshot": {"every": 5, "max_every": 4}})
    assert config_from_dict({"snapshot": {"every": 0, "max_every": 1}}).snapshot.interval == 0, "off is always allowed"


def test_the_public_api_takes_max_every_as_the_config_does() -> None:
    common = {"global_batch": 12, "max_steps": 10}
    assert options({}, **common).snapshot.max_every == 1
    assert options({}, **common, snapshot_max_every=4).snapshot.max_every == 4
    both = options({}, **common, snapshot_every=3, snapshot_max_every=3).snapshot
    assert (both.every, both.max_every) == (3, 3)
    section = options({}, **common, snapshot={"every": 2, "max_every": 6}).snapshot
    assert (section.every, section.max_every) == (2, 6)
    with pytest.raises(ConfigError, match="snapshot.max_every: must be >= 1"):
        options({}, **common, snapshot_max_every=0)
    with pytest.raises(ConfigError, match="snapshot.every: 3 is more than snapshot.max_every=1"):
        options({}, **common, snapshot_every=3)


def test_auto_spaces_snapshots_so_they_cost_under_two_percent_of_the_step_time() -> None:
    meter = CostMeter()
    meter.record(3.0, busy=False)  # a world's first step warms up: not part of the baseline
    for _ in range(3):
        meter.record(1.0, busy=False)
    assert meter.has_baseline() and meter.cost() == 0.0, "nothing measured with a snapshot yet"
    assert not meter.measured()
    meter.record(1.1, busy=True)  # a snapshot slowed its step by 10%
    meter.snapshot_done()
    assert meter.measured() and meter.cost() == pytest.approx(0.1)
    assert interval_for(meter.cost(), max_every=100).every == 5, "10% per snapshot, every 5 steps: 2%"
    for _ in range(2):  # the next snapshot overlapped two steps, each 10% slower
        meter.record(1.1, busy=True)
    meter.snapshot_done()
    assert interval_for(meter.cost(), max_every=100).every == 10
    assert [interval_for(c, max_every=100).every for c in (0.0, 0.019, 0.021)] == [1, 1, 2]
    meter.record(0.9, busy=True)  # faster than the baseline: noise, not a negative cost
    assert meter.cost() >= 0.0


def test_auto_never_spaces_snapshots_wider_than_max_every() -> None:
    # The busy node's measurement: a snapshot cost 34.81% of a step, so 2% wants every 18 steps.
    capped = interval_for(0.3481, max_every=1)
    assert (capped.every, capped.wanted, capped.capped) == (1, 18, True)
    assert "capped at snapshot.max_every=1" in capped.reason and "34.8%" in capped.reason
    assert interval_for(0.3481, max_every=4).every == 4
    raised = interval_for(0.3481, max_every=40)
    assert (raised.every, raised.capped) == (18, False), "a raised bound lets the cost decide"
    assert "capped" not in raised.reason
    for cost in (0.0, 0.01, 0.05, 0.3481, 2.0, 1e6):
        for max_every in (1, 2, 7, 1000):
            chosen = interval_for(cost, max_every)
            assert 1 <= chosen.every <= max_every, (cost, max_every, chosen)
            assert chosen.every == min(chosen.wanted or 0, max_every)


def test_auto_starts_at_max_every_until_the_cost_is_measured() -> None:
    """Before a cost is known the widest the bound allows: it leaves steps without a
    snapshot to measure against, and never more than ``max_every`` of them."""
    unknown = interval_for(None, max_every=6)
    assert (unknown.every, unknown.wanted, unknown.capped) == (6, None, False)
    assert "not measured" in unknown.reason
    assert interval_for(None, max_every=1).every == 1


@pytest.fixture
def world_of_one() -> Iterator[Runtime]:
    rt = init_runtime({}, "cpu", timeout=timedelta(minutes=1))  # gloo, in this process
    try:
        yield rt
    finally:
        dist.destroy_process_group()


def _boundaries(snaps: Snapshots, steps: range, step_s: dict[bool, float], cost: float) -> list[int]:
    """Play the loop's side of ``steps`` boundaries in a world of one: a step beside a snapshot
    takes ``step_s[True]``, one without ``step_s[False]``; every boundary agrees on ``cost``.
    The steps at which a snapshot was taken."""
    taken = []
    for step in steps:
        snaps.wait_copied()
        snaps.before_step_counts(step)
        done = snaps.done(step)
        snaps.observe(step_s[snaps.in_flight is not None])  # the step that just ran
        snaps.agreed(done, cost if snaps.meter.measured() else 0.0)
        if snaps.due(step):
            snaps.take(step)
            taken.append(step)
        snaps.settled()
    return taken


@pytest.mark.parametrize("max_every", [1, 3])
def test_a_costly_snapshot_is_still_taken_every_max_every_steps_and_the_cap_is_logged(
    world_of_one: Runtime, max_every: int
) -> None:
    cfg = config_from_dict({"model": {"dim": 32, "n_layers": 1, "n_heads": 2, "seq_len": 8}})
    model = build_sharded_model(cfg.model, 0, world_of_one.mesh, world_of_one.device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # AdamW's state exists: the snapshots can be laid out
    snaps = Snapshots(model, optimizer, 0, 1, ("", "n"), None, timedelta(minutes=1), max_every=max_every)
    with capture_logs() as logs:
        while not snaps.done(0):  # the buffers are allocated in the background
            time.sleep(0.01)
        snaps.agreed(True, 0.0)
        # Steps beside a snapshot take 35% longer: 2% of the step time would want every 18.
        taken = _boundaries(snaps, range(1, 40), {False: 1.0, True: 1.35}, cost=0.35)
    assert taken[0] == 1, "the first snapshot comes as soon as every rank has its buffers"
    assert all(b - a <= max_every for a, b in zip(taken, taken[1:], strict=False)), taken
    assert taken[-1] >= 39 - max_every
    chosen = [e for e in logs if e["event"] == "snapshot interval"]
    assert chosen and chosen[-1]["every"] == max_every and chosen[-1]["max_every"] == max_every
    if max_every > 1:  # with max_every 1 no step runs without a snapshot: nothing to measure against
        assert snaps.meter.has_baseline() and len(snaps.meter.quiet) >= QUIET_STEPS
        assert chosen[-1]["capped"] is True and chosen[-1]["wanted"] == 18, chosen
        assert chosen[-1]["cost_share"] == pytest.approx(0.35)
    assert snaps.every == max_every
    snaps.close()


def test_a_model_sharded_over_a_two_dimensional_mesh_is_refused_saying_what_to_set(world_of_one: Runtime) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Linear(8, 4)
    fully_shard(model, mesh=mesh)  # HSDP: replicated over one dimension, sharded over the other
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"^snapshot.every: .*2-D mesh \(HSDP\).*set snapshot.every: 0"):
        Snapshots(model, optimizer, 0, 1, ("", "n"), 1, timedelta(minutes=1))
