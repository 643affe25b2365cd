"""One labelling of what started a re-form (``regroup.reform_causes``): the controller's
Event, ``regroup trace-report`` and the demo's report say the same for a drain, an
eviction, a spot reclaim, a plain reclaim and a crash."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from regroup import trace_report
from regroup.controller.reform_summary import completion_event, resize_message
from regroup.demo.analysis import load_run, reform_label, reform_rows
from regroup.records import ReformPlan
from regroup.reform_causes import CORDON, UNCORDON, cause_label, cordoned_at
from tests.demo.recorded import T0, progress_rows, write_run
from tests.whatif.spans import RecordedJob

EVICTED = "reclaim notice on n2 (pod demo-n2 DisruptionTarget (EvictionByEvictionAPI), Kubernetes)"
SPOT = "reclaim notice on n2 (aws-node-termination-handler/spot-itn, AWS node-termination-handler)"
TAINT = "reclaim notice on n2 (example.com/going, regroup.dev/reclaim-taints)"


def test_an_eviction_of_a_cordoned_node_is_a_drain() -> None:
    assert cause_label("reclaim", EVICTED) == "eviction"
    assert cause_label("reclaim", EVICTED, cordoned={"n2"}) == "drain"
    assert cause_label("reclaim", EVICTED, cordoned={"n3"}) == "eviction"
    assert cause_label("reclaim", SPOT, cordoned={"n2"}) == "spot reclaim"
    assert cause_label("reclaim", TAINT) == "reclaim"
    deleted = "reclaim notice on n2 (pod demo-n2 deleted (30 s grace), Kubernetes)"
    assert cause_label("reclaim", deleted, cordoned={"n2"}) == "drain"
    # Each node's notice reads on its own: only the cordoned node's eviction is a drain.
    two = ("reclaim notice on n2 (pod demo-n2 DisruptionTarget (EvictionByEvictionAPI), Kubernetes), "
           "n3 (pod demo-n3 DisruptionTarget (EvictionByEvictionAPI), Kubernetes)")  # fmt: skip
    assert cause_label("reclaim", two, cordoned={"n3"}) == "eviction+drain"
    assert cause_label("crash", "n1 left") == "crash"


def test_a_cordon_counts_until_it_is_lifted() -> None:
    marks = [(1.0, CORDON, ("n2",)), (2.0, "Evicted", ("n2",)), (5.0, UNCORDON, ("n2",)), (6.0, CORDON, ("n3",))]
    assert cordoned_at(marks, 0.5) == set()
    assert cordoned_at(marks, 3.0) == {"n2"}
    assert cordoned_at(marks, 7.0) == {"n3"}


def _plan(reason: str) -> ReformPlan:
    return ReformPlan(
        generation=1, cause="reclaim", planned=True, phase="done", reason=reason, nodes_before=["n1", "n2", "n3"],
        nodes_after=["n1", "n3"], trace_id="0" * 32, detected_at=T0, decided_at=T0, resumed_at=T0 + 0.6,
        finished_at=T0 + 0.7, lost_steps=0, outcome="completed",
    )  # fmt: skip


def _drained_run(root: Path, reason: str, events: list[dict]) -> Path:
    write_run(root, "regroup", progress_rows([(0, 1, 20, 0.0, 3), (20, 21, 40, 11.0, 2)]), events, 21.0)
    job = RecordedJob(root / "spans.jsonl")
    reclaim = job.reform("reclaim", 3, 2, 10.0, planned=True, checkpoint=0.3, rendezvous=0.2, resume=0.5,
                         reason=reason)  # fmt: skip
    job.resume(reclaim, 10.5, 11.0, resumed_from=20, world=2)
    job.close()
    return root


def _trace_report_label(root: Path, capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser()
    trace_report.add_arguments(parser)
    assert trace_report.run(parser.parse_args([str(root), "--json"])) == 0
    [reform] = json.loads(capsys.readouterr().out)
    return reform["label"]


@pytest.mark.parametrize(
    ("reason", "cordoned", "word"),
    [(EVICTED, True, "drain"), (EVICTED, False, "eviction"), (SPOT, False, "spot reclaim"), (TAINT, False, "reclaim")],
    ids=["drain", "eviction", "spot", "reclaim"],
)
def test_the_event_the_trace_report_and_the_demo_say_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reason: str, cordoned: bool, word: str
) -> None:
    cordon = {"time": 9.9, "source": "cluster", "reason": CORDON, "message": "drained", "nodes": ["n2"]}
    root = _drained_run(tmp_path / "run", reason, [cordon] if cordoned else [])
    run = load_run(root)
    [row] = reform_rows(run)
    assert reform_label(run, row) == word
    assert _trace_report_label(root, capsys) == word
    nodes = {"n2"} if cordoned else set()
    assert resize_message(_plan(reason), cordoned=nodes).startswith(f"3 → 2 nodes: {word} of n2, 0 steps lost, ")
    assert completion_event(_plan(reason), cordoned=nodes)[1] == resize_message(_plan(reason), cordoned=nodes)
