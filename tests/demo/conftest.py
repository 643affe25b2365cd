"""The short scenario played once per session, for every test that reads a real run."""

from __future__ import annotations

import pytest

from regroup.demo.analysis import RunData, load_run
from tests.demo.demo_runs import play_demo


@pytest.fixture(scope="session")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> RunData:
    """``regroup demo --scenario short`` to its end (about 2 minutes on 2 idle cores)."""
    out = tmp_path_factory.mktemp("demo")
    stdout = play_demo(out, "--scenario", "short")
    run_dir = out / "run"
    assert (run_dir / "report.html").is_file()
    assert f"report: {run_dir.resolve() / 'report.html'}" in stdout
    return load_run(run_dir)
