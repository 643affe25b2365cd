"""``regroup demo`` played to its end by the tests, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from regroup.demo.scenario import load_scenario, parse_duration, resolve_scenario_path
from tests.conftest import REPO

# About 2 minutes on an idle 2-core machine; a loaded one stretches the re-forms, and the
# script waits for each to finish, so the bound is generous.
DEMO_TIMEOUT = 480


class DemoPlay:
    """``regroup demo --no-live ARGS`` (from the repository root) started in the background:
    its output goes to files beside the run, so plays started together never block on a
    full pipe. ``finish()`` waits for its end; ``stop()`` ends it if nobody did."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out, self.args = out, args
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "regroup.cli", "demo", "--out", str(out), "--name", "run", "--no-live", *args]
        self.stdout_path, self.stderr_path = out / "demo.stdout", out / "demo.stderr"
        with open(self.stdout_path, "wb") as stdout, open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=REPO)
        self.started = time.monotonic()

    def _output(self) -> tuple[str, str]:
        return self.stdout_path.read_text(errors="replace"), self.stderr_path.read_text(errors="replace")

    def finish(self) -> str:
        """Wait for the demo's end (``DEMO_TIMEOUT`` from its start); its stdout."""
        try:
            self.process.wait(timeout=max(1.0, self.started + DEMO_TIMEOUT - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            stdout, stderr = self._output()
            pytest.fail(
                f"regroup demo {' '.join(self.args)} did not finish within {DEMO_TIMEOUT}s: {stdout[-2000:]}{stderr[-2000:]}"
            )
        stdout, stderr = self._output()
        assert self.process.returncode == 0, stdout[-3000:] + stderr[-3000:]
        return stdout

    def stop(self) -> None:
        """End the demo if it still runs: SIGTERM lets it stop its agents, trainers and etcd first."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def play_demo(out: Path, *args: str) -> str:
    """``regroup demo --no-live ARGS`` to its end (from the repository root); its stdout."""
    play = DemoPlay(out, *args)
    try:
        return play.finish()
    finally:
        play.stop()


# The script run: ``regroup demo --script`` on the short scenario's first 52 s.

SCRIPT = "examples/fsdp2/train.py"
PLAYED = timedelta(seconds=52)
"""The part of the short scenario the script run plays: its reclaim, abrupt loss and restore."""


def script_command() -> list[str]:
    """The training command the demo runs on every rank, as ``regroup demo`` takes it: a
    global batch that splits over 1, 2 and 3 nodes, and more steps than the scenario lasts."""
    return ["--script", SCRIPT, "--", "--batch-size", "12", "--steps", "100000"]


def first_part_of_short(folder: Path) -> Path:
    """The short scenario cut to its first ``PLAYED`` seconds, its events too (a run plays
    every event of its scenario, whatever its duration), as a file of the same name: the
    run is still the ``short`` scenario's."""
    body = yaml.safe_load(resolve_scenario_path("short").read_text())
    body["duration"] = f"{PLAYED.total_seconds():.0f}s"
    body["events"] = [e for e in body["events"] if parse_duration(e["at"], "at") < PLAYED]
    path = folder / "short.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    scenario = load_scenario(path)
    assert scenario.name == "short" and [e.action for e in scenario.events] == ["reclaim", "lose", "restore"]
    return path
