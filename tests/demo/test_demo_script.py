"""``regroup demo --script``: the short scenario, played with the real controller against a
training script given by path instead of the built-in trainer (``-m regroup.trainer``).

The script reads everything from the environment the demo sets for every worker
(``REGROUP_ETCD_ENDPOINT``, ``REGROUP_CHECKPOINT_DIR``, ``REGROUP_SAMPLE_LOG``); its config
file only sizes the model. Every fact is read from the run's records, never from log text.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from regroup.demo.analysis import RunData, load_run
from regroup.demo.nodes import DEFAULT_TRAINER
from regroup.trace_report import reforms_from_spans
from tests.conftest import REPO

DEMO_TIMEOUT = 480
pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT + 90)]


def script_command(config: Path) -> list[str]:
    """The training command the demo runs on every rank, as ``regroup demo`` takes it.
    Until the user-script API's example exists, the built-in trainer's entry file run as a
    script; to play the example instead, this line becomes
    ``return ["--script", "examples/fsdp2/train.py"]``."""
    return ["--script", "trainer/__main__.py", "--", "--config", str(config)]


@pytest.fixture(scope="module")
def script_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunData, str]:
    out = tmp_path_factory.mktemp("demo-script")
    # Only the model's size and the cadence: no etcd endpoint, job, checkpoint folder or
    # sample log in it, so the script finds them in its environment or not at all.
    config = out / "model.yaml"
    config.write_text(yaml.safe_dump({**DEFAULT_TRAINER, "etcd": {"progress_interval": "250ms"}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "regroup.cli", "demo", "--scenario", "short", "--out", str(out), "--name", "run"]
    demo = subprocess.Popen(
        [*argv, "--no-live", *script_command(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        stdout, stderr = demo.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the demo stop its agents, trainers and etcd before it exits.
        demo.send_signal(signal.SIGTERM)
        stdout, stderr = demo.communicate(timeout=60)
        pytest.fail(f"regroup demo --script did not finish within {DEMO_TIMEOUT}s: {stdout[-2000:]}{stderr[-2000:]}")
    assert demo.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return load_run(out / "run"), stdout


def test_the_report_is_written_and_names_each_re_form(script_run: tuple[RunData, str]) -> None:
    run, stdout = script_run
    report = run.root / "report.html"
    assert report.is_file()
    assert f"report: {report.resolve()}" in stdout and "script: " in stdout
    assert run.script is not None and run.script[0].endswith("trainer/__main__.py")
    causes = {r.cause for r in reforms_from_spans(run.spans)}
    assert {"reclaim", "node-lost", "grow"} <= causes, causes
    text = report.read_text()
    for cause in ("reclaim", "node-lost", "grow"):
        assert cause in text, f"the report does not name the {cause} re-form"
    assert "trainer/__main__.py" in text
    unsettled = [e.message for e in run.events if e.reason == "NotSettled"]
    assert not unsettled, unsettled


def test_the_script_found_the_runs_etcd_checkpoints_and_sample_logs(script_run: tuple[RunData, str]) -> None:
    run, _ = script_run
    # Progress in the run's etcd, checkpoints in its folder, sample logs in its folder: the
    # script's config named none of them.
    assert run.progress and max(p.step for p in run.progress) > 0
    assert run.meta["latest_checkpoint_step"] is not None
    assert sorted(p.name for p in (run.root / "samples").glob("samples-w*-r*.jsonl")), "no sample log written"
    assert not (run.root / "trainer.yaml").exists(), "the built-in trainer's config is not written for a script"
