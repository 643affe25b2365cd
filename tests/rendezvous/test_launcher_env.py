"""``regroup-run`` gives its workers the job's etcd: ``REGROUP_ETCD_ENDPOINT`` from
``--rdzv-endpoint`` with the ``etcd-v3`` backend, unless the environment sets it already.
Real etcd, a real one-node ``regroup-run``, a real worker process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from regroup.demo.etcd_server import EtcdServer

WORKER = """
import os, sys
with open(sys.argv[1], "w") as out:
    out.write(os.environ.get("REGROUP_ETCD_ENDPOINT", "<unset>"))
"""

pytestmark = pytest.mark.timeout(240)


def _worker_sees(etcd: EtcdServer, tmp_path: Path, env: dict[str, str], job: str) -> str:
    script, seen = tmp_path / "worker.py", tmp_path / f"seen-{job}"
    script.write_text(WORKER)
    argv = [
        sys.executable, "-m", "regroup.rendezvous.inplace.launcher",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={job}",
        "--nnodes=1", "--nproc-per-node=1", "--max-restarts=0", "--monitor-interval=0.1",
        str(script), str(seen),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return seen.read_text()


def test_a_worker_finds_the_rendezvous_etcd_with_no_configuration(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    env = {k: v for k, v in worker_env.items() if k != "REGROUP_ETCD_ENDPOINT"}
    assert _worker_sees(etcd, tmp_path, env, "plain") == etcd.endpoint
    # A value the worker's environment already has is kept.
    assert _worker_sees(etcd, tmp_path, {**env, "REGROUP_ETCD_ENDPOINT": "elsewhere:2379"}, "mine") == "elsewhere:2379"
