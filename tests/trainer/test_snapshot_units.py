"""The pure parts of in-memory snapshots: buddy placement, buffer layout, the memory check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from regroup.trainer.config import ConfigError
from regroup.trainer.config_loading import config_from_dict
from regroup.trainer.reshard import HeldState
from regroup.trainer.snapshot_cost import CostMeter, SnapshotMemoryError, check_host_memory, host_memory_available, interval_for
from regroup.trainer.snapshot_layout import Layout, buddies, layout_for


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


def test_a_rank_layout_is_derived_from_any_rank_state() -> None:
    # Rows 5 over 4 ranks (torch.chunk: 2, 2, 1, 0); AdamW's step is a plain scalar.
    shapes = {"model/w": (5, 3), "optim/state.w.step": ()}
    template = HeldState(
        0, 4, 1, {"model/w": torch.zeros(2, 3), "optim/state.w.step": torch.zeros(())},
        frozenset({"model/w"}), shapes, {},
    )  # fmt: skip
    rows = [dict((e.key, e.shape) for e in layout_for(template, r, 4).entries)["model/w"] for r in range(4)]
    assert rows == [(2, 3), (2, 3), (1, 3), (0, 3)]
    layout = layout_for(template, 2, 4)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    views["model/w"].fill_(1.5)
    views["optim/state.w.step"].fill_(7)
    layout.stamp(buffer).copy_(torch.tensor([3, 2]))
    again = layout.views(buffer)
    assert torch.equal(again["model/w"], torch.full((1, 3), 1.5)) and again["optim/state.w.step"].item() == 7
    assert layout.stamp(buffer).tolist() == [3, 2]
    assert all(e.offset % 16 == 0 for e in layout.entries)
    assert Layout.of([("x", (3,), torch.float32)]).nbytes == 32  # 12 bytes aligned to 16, then the stamp


def test_the_trainer_refuses_snapshots_host_memory_cannot_hold() -> None:
    check_host_memory(1 << 30, 4, 8 << 30)  # 4 GiB of 8: fine
    with pytest.raises(SnapshotMemoryError, match=r"snapshot.every: .*\(4 on this node: 8.00 GiB\).*snapshot.every: 0"):
        check_host_memory(2 << 30, 4, 8 << 30)
    assert isinstance(SnapshotMemoryError("x"), ConfigError), "the trainer exits with a configuration error"


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
    assert config_from_dict({"snapshot": {"every": 5}}).snapshot.interval == 5
    with pytest.raises(ConfigError, match="snapshot.every: must be >= 0 or auto"):
        config_from_dict({"snapshot": {"every": -1}})
    with pytest.raises(ConfigError, match="snapshot.every: expected an integer, got 'sometimes' or must be one of"):
        config_from_dict({"snapshot": {"every": "sometimes"}})


def test_auto_spaces_snapshots_so_they_cost_under_two_percent_of_the_step_time() -> None:
    meter = CostMeter()
    meter.record(3.0, busy=False)  # a world's first step warms up: not part of the baseline
    for _ in range(3):
        meter.record(1.0, busy=False)
    assert meter.has_baseline() and meter.cost() == 0.0, "nothing measured with a snapshot yet"
    meter.record(1.1, busy=True)  # a snapshot slowed its step by 10%
    meter.snapshot_done()
    assert meter.cost() == pytest.approx(0.1)
    assert interval_for(meter.cost()) == 5, "10% per snapshot, every 5 steps: 2%"
    for _ in range(2):  # the next snapshot overlapped two steps, each 10% slower
        meter.record(1.1, busy=True)
    meter.snapshot_done()
    assert interval_for(meter.cost()) == 10
    assert interval_for(0.0) == 1 and interval_for(0.019) == 1 and interval_for(0.021) == 2
    assert interval_for(1e6) == 1000, "bounded"
    meter.record(0.9, busy=True)  # faster than the baseline: noise, not a negative cost
    assert meter.cost() >= 0.0
