"""``make demo``'s set-up on a fresh machine: its apt-get calls wait for the dpkg lock that
another apt (unattended-upgrades, cloud-init) holds at first boot, instead of failing at once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


from tests.conftest import REPO

LOCK_WAIT = "-o DPkg::Lock::Timeout=600"
MAKE = shutil.which("make")


def test_the_apt_step_waits_for_the_dpkg_lock(tmp_path: Path) -> None:
    # A PATH with a fake apt-get and nothing else: etcd is "missing", so the step installs it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-get.calls"
    fake = bin_dir / "apt-get"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    assert MAKE is not None
    result = subprocess.run(
        [MAKE, "--no-print-directory", "-C", str(REPO), "etcd"],
        env={**{k: v for k, v in os.environ.items() if k.startswith("LC_") or k == "LANG"}, "PATH": str(bin_dir)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    update, install = calls.read_text().splitlines()
    assert update == f"{LOCK_WAIT} update"
    assert install == f"{LOCK_WAIT} install -y --no-install-recommends etcd-server"


def test_every_apt_get_of_the_makefile_waits_for_the_lock() -> None:
    recipes = [
        line for line in (REPO / "Makefile").read_text().splitlines()
        if "apt-get" in line and not line.lstrip().startswith("#")
    ]  # fmt: skip
    assert recipes, "no apt-get call found"
    for line in recipes:
        calls = re.findall(r"\$\(APT_GET\)|apt-get[^;|&}]*", line)
        for call in calls:
            assert call == "$(APT_GET)" or LOCK_WAIT in call, line
