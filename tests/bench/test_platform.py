"""``bench platform`` at its smallest: the report's shape and sane numbers (not the speed),
the end check of what ended jobs left behind, and the profile readers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from bench.platform.observe import EtcdGateway
from bench.platform.profiles import collapsed_hotspots, pprof_hotspots
from regroup.demo.etcd_server import EtcdServer

LEASE_TTL = 2.0
RETENTION = 2.0
"""The controller's ``--retention`` (default 10 s): the end check of each size waits for it
to pass before the clean-up removes the ended jobs' keys and tombstones."""
SMALLEST = ["--jobs", "1", "--agents", "2", "--probes", "1", "--churn", "6", "--warmup", "0", "--profile", "0",
            "--lease-ttl", str(LEASE_TTL), "--step-time", "0.5", "--join-window", "1",
            "--retention", str(RETENTION), "--auth", "off"]  # fmt: skip
"""Auth off: the platform as it was; ``test_platform_auth`` checks what auth on adds."""


def test_smallest_run_reports_every_size_with_sane_numbers(tmp_path: Path, worker_env: dict[str, str]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench", "platform", *SMALLEST, "--out", str(tmp_path), "--name", "t"],
        env=worker_env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    folder = tmp_path / "t"
    report = json.loads((folder / "platform.json").read_text())
    table = (folder / "platform.md").read_text()
    for heading in ("## etcd", "## controller and probe job", "## per background job", "Where it bends, auth off:", "## nothing left behind"):
        assert heading in table, heading

    alone, loaded = report["sizes"]
    assert (alone["jobs"], loaded["jobs"]) == (0, 1)
    for size in (alone, loaded):
        assert not size["errors"], size["errors"]
        rates, gauges, processes = size["rates"], size["gauges"], size["processes"]
        # Every agent refreshes its lease and the jobs write: etcd is busy, within reason.
        assert 0 < rates["etcd_mvcc_put_total"] < 10_000
        assert rates["etcd_debugging_lease_renewed_total"] > 0
        assert rates["etcd_debugging_mvcc_events_total"] > 0
        assert gauges["etcd_debugging_mvcc_watcher_total"] >= 1
        # Each live agent holds a lease of its own during the window; none is left at the end.
        assert size["leases"] > size["end"]["leases_start"]
        for name in ("etcd", "controller"):
            assert 0 < processes[name]["cpu_cores"] <= 2.0 * (1 + size["jobs"])
            assert 5 < processes[name]["rss_mb"] <= processes[name]["peak_rss_mb"] < 4096
        probe = size["probe"]
        for kind in ("reclaim", "loss", "grow"):
            assert probe[kind]["failed"] == 0, (size["jobs"], kind, probe)
            assert 0 < probe[kind]["p50_s"] <= probe[kind]["p99_s"] < 60
        # Nothing tells a job of an agent that died but the lease running out.
        assert probe["loss"]["p50_s"] >= LEASE_TTL / 2
        end = size["end"]
        assert end["ended_jobs"] >= 1 + size["jobs"]
        assert end["leases_end"] == end["leases_start"]
        assert 0 < end["db_bytes_after"] <= end["db_bytes_before"]
        # The controller's clean-up removed every ended job's keys and tombstone after the retention.
        assert end["clean"], end
        assert end["retention_s"] == RETENTION, end
    assert loaded["churn"]["rate_per_job_min"] == 6


def test_etcd_cpu_profile_is_read_into_etcd_functions(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd", extra_args=("--enable-pprof",)) as etcd:
        gateway = EtcdGateway(etcd.url)
        done = threading.Event()

        def write() -> None:
            # Keep etcd busy for the profile: range counts through the gateway.
            while not done.is_set():
                gateway.count("/regroup/")

        writer = threading.Thread(target=write)
        writer.start()
        try:
            ranking = pprof_hotspots(gateway.cpu_profile(1))
        finally:
            done.set()
            writer.join()
    assert ranking.samples > 0
    names = [h.function for h in ranking.by_self + ranking.by_total]
    assert any(name.startswith(("go.etcd.io/", "google.golang.org/grpc", "runtime.")) for name in names), names
    assert all(0 < h.self_share <= h.total_share <= 1 for h in ranking.by_self)
    assert sum(h.self_share for h in ranking.by_self) <= 1 + 1e-9


def test_collapsed_stacks_rank_own_and_cumulative_time(tmp_path: Path) -> None:
    path = tmp_path / "spy.txt"
    path.write_text(
        "<module> (run.py:1);main (run.py:5);decide (decide.py:10) 6\n"
        "<module> (run.py:1);main (run.py:5);encode (json/encoder.py:200) 3\n"
        "<module> (run.py:1);main (run.py:5) 1\n"
    )
    ranking = collapsed_hotspots(path)
    assert ranking.samples == 10
    assert [(h.function, h.self_share) for h in ranking.by_self] == [
        ("decide (decide.py)", 0.6), ("encode (json/encoder.py)", 0.3), ("main (run.py)", 0.1)
    ]  # fmt: skip
    # <module> and main are under every sample: roots, not where the time goes; the standard
    # library's frames say whose work it was no better.
    assert [h.function for h in ranking.by_total] == ["decide (decide.py)"]


def test_bad_sizes_are_refused_naming_the_option(worker_env: dict[str, str]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench", "platform", "--jobs", "10,x"], env=worker_env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "--jobs" in run.stderr, run.stderr
