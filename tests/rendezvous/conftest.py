"""Fixtures of the rendezvous tests: torchrun agents on one real etcd."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from regroup.demo.etcd_server import EtcdServer
from tests.rendezvous.agents import TorchrunNodes


@pytest.fixture
def nodes(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[TorchrunNodes]:
    """torchrun agents posing as nodes of job ``job``; all killed after the test."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agents = TorchrunNodes(endpoint=etcd.endpoint, out=tmp_path / "out", env=worker_env, torchrun=torchrun)
    try:
        yield agents
    finally:
        agents.cleanup()
