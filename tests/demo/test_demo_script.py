"""``regroup demo --script``: the short scenario's first 52 s (a reclaim, an abrupt loss and
the grow back), played with the real controller against a script nobody here wrote (PyTorch's FSDP2 example, converted: examples/fsdp2/train.py)
instead of the built-in trainer. A run plays every event of its scenario whatever its
duration, so the run is given the short scenario without the events after its first 52 s
(the flaky node at 66 s, which ``short_run`` plays with the built-in trainer).

The script reads everything from the environment the demo sets for every worker
(``REGROUP_ETCD_ENDPOINT``, ``REGROUP_CHECKPOINT_DIR``, ``REGROUP_SAMPLE_LOG``). Every fact is
read from the run's records, never from log text.
"""

from __future__ import annotations

import pytest

from regroup.demo.analysis import RunData
from regroup.trace_report import reforms_from_spans
from tests.conftest import REPO
from tests.demo.demo_runs import DEMO_TIMEOUT, SCRIPT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT + 90)]


# ``script_run`` (tests/demo/conftest.py): the run, played once per session.


def test_the_report_is_written_and_names_each_re_form(script_run: tuple[RunData, str]) -> None:
    run, stdout = script_run
    report = run.root / "report.html"
    assert report.is_file()
    assert f"report: {report.resolve()}" in stdout and "script: " in stdout
    assert run.script is not None and run.script[0].endswith(SCRIPT)
    causes = {r.cause for r in reforms_from_spans(run.spans)}
    assert {"reclaim", "node-lost", "grow"} <= causes, causes
    text = report.read_text()
    for cause in ("reclaim", "node-lost", "grow"):
        assert cause in text, f"the report does not name the {cause} re-form"
    assert SCRIPT in text
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
    # The script's own relative paths (upstream's Checkpointer writes checkpoints/) stay in its node's folder.
    assert not (REPO / "checkpoints").exists()
