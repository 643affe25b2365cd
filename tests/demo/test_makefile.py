"""``make demo``'s set-up on a fresh machine: its apt-get calls wait for the locks (dpkg's, and
the package lists' that ``apt-get update`` takes) that another apt (unattended-upgrades,
cloud-init) holds at first boot, instead of failing at once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


from tests.conftest import REPO

LOCK_WAIT = "-o DPkg::Lock::Timeout=600"
MAKE = shutil.which("make")


def make_etcd_with(tmp_path: Path, apt_get: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``make etcd`` on a PATH holding a fake ``apt-get`` (the bash body ``apt_get``; it sees its
    call count in ``$N``), an instant ``sleep`` and nothing else: etcd is "missing", so the
    step installs it. The result, and each apt-get call's arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-get.calls"
    fake = bin_dir / "apt-get"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\nmapfile -t seen < {calls}; N=${{#seen[@]}}\n{apt_get}\n')
    (bin_dir / "sleep").write_text("#!/bin/bash\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    assert MAKE is not None
    result = subprocess.run(
        [MAKE, "--no-print-directory", "-C", str(REPO), "etcd"],
        env={**{k: v for k, v in os.environ.items() if k.startswith("LC_") or k == "LANG"}, "PATH": str(bin_dir)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return result, calls.read_text().splitlines()


def test_the_apt_step_waits_for_the_dpkg_lock(tmp_path: Path) -> None:
    result, calls = make_etcd_with(tmp_path, "exit 0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{LOCK_WAIT} update", f"{LOCK_WAIT} install -y --no-install-recommends etcd-server"]


def test_the_apt_step_waits_while_another_apt_holds_the_package_lists(tmp_path: Path) -> None:
    # DPkg::Lock::Timeout does not cover apt-get update's lock: the first two tries find it held.
    held = 'if [ "$N" -le 2 ]; then echo "E: Could not get lock /var/lib/apt/lists/lock" >&2; exit 100; fi'
    result, calls = make_etcd_with(tmp_path, held)
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{LOCK_WAIT} update"] * 3 + [f"{LOCK_WAIT} install -y --no-install-recommends etcd-server"]
    assert result.stderr.count("locked by another apt; waiting") == 2, result.stderr


def test_an_apt_update_that_fails_otherwise_fails_the_step_at_once(tmp_path: Path) -> None:
    result, calls = make_etcd_with(tmp_path, 'echo "E: The repository is not signed" >&2; exit 100')
    assert result.returncode != 0 and "not signed" in result.stderr
    assert calls == [f"{LOCK_WAIT} update"]


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
