"""etcd-v3 against torch's own rendezvous scenarios, with torch's c10d as the control.

One test: every scenario of ``scenarios.SCENARIOS`` on both backends (five at a time),
the scenario x backend table printed to the terminal (with or without ``-s``) and written
to ``<tmp>/conformance.md``. Every scenario c10d passes must pass on etcd-v3 too, unless
``NOT_APPLICABLE`` says why not; so must those c10d fails through a known torch bug
(``C10D_KNOWN_FAILURES``) and those only etcd-v3 runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from regroup.demo.etcd_server import EtcdServer
from tests.rendezvous.conformance.backends import C10d, EtcdV3
from tests.rendezvous.conformance.processes import child_env, launcher_for
from tests.rendezvous.conformance.runner import run_all, table
from tests.rendezvous.conformance.scenarios import C10D_KNOWN_FAILURES, NOT_APPLICABLE, SCENARIOS

pytestmark = pytest.mark.slow

THREADS = 5
"""Scenarios run at once. A scenario mostly waits (timeouts, leases, agents starting): on
2 cores the whole run used about 28 s of CPU in 47 s at three at a time, the same in
33 s at five."""


def test_etcd_v3_passes_every_torch_scenario_that_c10d_passes(
    etcd: EtcdServer, tmp_path: Path, python: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = child_env(dict(os.environ))
    started = time.monotonic()
    with launcher_for(python, env, tmp_path / "launcher.log") as launcher:
        results = run_all(SCENARIOS, [EtcdV3(etcd.endpoint), C10d()], tmp_path / "runs", launcher, env, THREADS)
    seconds = time.monotonic() - started
    results_table = table(SCENARIOS, results, NOT_APPLICABLE, C10D_KNOWN_FAILURES)
    report = f"{results_table}\n\n{len(results)} runs in {seconds:.0f}s ({tmp_path})\n"
    (tmp_path / "conformance.md").write_text(report)
    with capsys.disabled():
        print(f"\ntorch rendezvous conformance, etcd-v3 vs c10d\n{report}")

    by = {(r.scenario.key, r.backend): r for r in results}
    gaps = []
    for scenario in SCENARIOS:
        ours = by[(scenario.key, "etcd-v3")]
        control = by.get((scenario.key, "c10d"))
        if ours.passed or scenario.key in NOT_APPLICABLE:
            continue
        if control is None or control.passed or scenario.key in C10D_KNOWN_FAILURES:
            gaps.append(f"{scenario.key}: {ours.note}\n{ours.detail}")
    assert not gaps, "etcd-v3 fails where c10d passes (or fails through a known torch bug):\n\n" + "\n\n".join(gaps)
