"""The rendezvous benchmark's join-window scenario, at a small N on real etcd."""

from __future__ import annotations

from bench._stats import percentile
from bench.rendezvous.join_window import measure_window, window_table
from regroup.demo.etcd_server import EtcdServer


def test_percentiles_are_nearest_rank() -> None:
    ordered = [float(i) for i in range(1, 101)]
    assert (percentile(ordered, 0.5), percentile(ordered, 0.99), percentile(ordered, 1.0)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 0.99) == 3.0 and percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0, "unsorted values are sorted first"


def test_join_window_waits_for_the_late_quarter_and_times_every_agent_from_the_last_arrival(etcd: EtcdServer) -> None:
    result = measure_window("etcd-v3", 8, {"etcd-v3": etcd.endpoint}, window=0.5, limit=60, fast=True)
    # One round of all 8 (3/4 waited in its join window for the last 2), and none of them
    # returned before the last arrival.
    assert result.note == "", result.note
    assert result.p50 is not None and result.p99 is not None and result.max is not None
    assert 0 <= result.p50 <= result.p99 <= result.max < 60
    assert "| join window (0.5 s) | 8 | etcd-v3 |" in window_table([result])
