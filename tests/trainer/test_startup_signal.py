"""A trainer stopped while it is still starting (an agent ending the job while a restarted
worker imports torch, as the demo's end does) exits 128+signal in silence: no
``KeyboardInterrupt`` traceback in the node's log."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO


def _importing_torch(pid: int) -> bool:
    """The process has loaded torch's C library and is still importing: torch's import
    takes seconds after it, so a signal now lands in the middle of it."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_sigint_while_the_trainer_imports_torch_exits_130_without_a_traceback(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    stderr = tmp_path / "stderr.log"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "regroup.trainer", "--config", str(tmp_path / "absent.yaml")],
            env=worker_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not _importing_torch(proc.pid):
                assert proc.poll() is None, stderr.read_text()
                assert time.monotonic() < deadline, "torch never loaded"
                time.sleep(0.005)  # polling /proc: there is no event to await
            proc.send_signal(signal.SIGINT)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = stderr.read_text()
    assert code == 128 + signal.SIGINT, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
