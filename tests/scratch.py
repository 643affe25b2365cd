"""A folder for a module- or session-scoped fixture, removed when the fixture ends.

``tmp_path``'s folders go when their test passes (``tmp_path_retention_policy`` in
pyproject); a wider fixture's folder from ``tmp_path_factory`` would stay until the
session ends, and the suite's runs (checkpoints of hundreds of MB, an etcd's 64 MB of
preallocated WAL each) would pile up on a small disk. This one goes with its fixture,
unless a test failed while it was there: then it stays to be read, as ``tmp_path``'s does.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def scratch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    failed = request.session.testsfailed
    path = tmp_path_factory.mktemp(name)
    try:
        yield path
    finally:
        if request.session.testsfailed == failed:
            shutil.rmtree(path, ignore_errors=True)
