"""``regroup demo`` played to its end by the tests, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# About 2 minutes on an idle 2-core machine; a loaded one stretches the re-forms, and the
# script waits for each to finish, so the bound is generous.
DEMO_TIMEOUT = 480


def play_demo(out: Path, *args: str) -> str:
    """``regroup demo --no-live ARGS`` to its end (from the repository root); its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "regroup.cli", "demo", "--out", str(out), "--name", "run", "--no-live", *args]
    demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        stdout, stderr = demo.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the demo stop its agents, trainers and etcd before it exits.
        demo.send_signal(signal.SIGTERM)
        stdout, stderr = demo.communicate(timeout=60)
        pytest.fail(f"regroup demo {' '.join(args)} did not finish within {DEMO_TIMEOUT}s: {stdout[-2000:]}{stderr[-2000:]}")
    assert demo.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout
