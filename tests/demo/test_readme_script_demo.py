"""The README's converted script ("your script in twenty lines"), tried the way the README
says: ``regroup demo --script train.py -- ARGS``, with the arguments the README gives. It
trains through a planned reclaim, re-formed in place with no step lost. A script that
finishes before the scenario's events (the README's, without its arguments, trains 3 epochs
in about a second) ends the demo at once: it says at which step the script finished, which
events it did not reach and what to change, and exits non-zero.

The scenario is the short one cut to its reclaim, on two nodes: the smallest run with an
in-place re-form (under 20 s on 2 idle cores). Every fact is read from the run's records.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from regroup.demo.analysis import event_impacts, load_run
from regroup.demo.nodes import RunLayout
from regroup.demo.recorder import JobRecorder
from regroup.demo.run_state import RunState
from regroup.demo.finished import finished_early
from regroup.demo.scenario import load_scenario, resolve_scenario_path
from regroup.etcd import EtcdSettings
from regroup.keys import JobKeys
from regroup.records import Progress
from regroup.trace_report import reforms_from_spans
from tests.conftest import REPO
from tests.demo.demo_runs import DemoPlay
from tests.docs.test_readme_script import _readme_diff, _side

pytestmark = pytest.mark.timeout(300)

ENDS_WITHIN = 120.0
"""A script that finished ends the demo in seconds; a demo that waited for it to train again
would wait out a settle (180 s) first."""


def _readme_demo_arguments() -> list[str]:
    """What the README passes its script after ``--`` in ``regroup demo --script train.py -- ARGS``."""
    text = (REPO / "README.md").read_text()
    found = re.findall(r"regroup demo --script train\.py -- (.*?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(found) == 1, f"the README should try its script with the demo once, found {found}"
    return shlex.split(found[0])


@pytest.fixture
def readme_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(_side(_readme_diff(), "+"))
    return script


@pytest.fixture
def reclaim_only(tmp_path: Path) -> Path:
    """The short scenario on two nodes, with only its reclaim (a planned shrink, in place)."""
    body = yaml.safe_load(resolve_scenario_path("short").read_text())
    reclaim = {**next(e for e in body["events"] if e["action"] == "reclaim"), "at": "2s"}
    # Long enough after the reclaim for its re-form to be over and the job to train on.
    body.update(nodes=2, duration="6s", events=[reclaim])
    body["job"]["max_nodes"] = 2
    path = tmp_path / "reclaim.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    assert [e.action for e in load_scenario(path).events] == ["reclaim"]
    return path


@pytest.mark.slow
def test_the_readme_script_re_forms_in_place_and_loses_no_step(
    readme_script: Path, reclaim_only: Path, tmp_path: Path
) -> None:
    args = _readme_demo_arguments()
    assert args, "the README should say how long to train its script in the demo"
    play = DemoPlay(tmp_path, "--scenario", str(reclaim_only), "--script", str(readme_script), "--", *args)
    try:
        play.finish()
    finally:
        play.stop()
    run = load_run(tmp_path / "run")
    assert run.script == [str(readme_script), *args]
    [reclaim] = [r for r in reforms_from_spans(run.spans) if r.cause == "reclaim"]
    assert reclaim.planned and reclaim.mode == "in-place", reclaim
    assert (reclaim.world_before, reclaim.world_after, reclaim.lost_steps) == (2, 1, 0), reclaim
    [impact] = event_impacts(run)
    assert impact.event.reason == "reclaim" and impact.lost_steps == 0, impact
    # The script trained on in the new world, after the re-form.
    after = [p for p in run.progress if p.time > impact.event.time and p.world_size == 1]
    assert after and after[-1].reform_mode == "in-place" and after[-1].step > after[0].resumed_from_step, after
    unsettled = [e.message for e in run.events if e.reason == "NotSettled"]
    assert not unsettled, unsettled


@pytest.mark.slow
def test_a_script_that_exits_at_once_ends_the_demo_saying_so(reclaim_only: Path, tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    play = DemoPlay(tmp_path, "--scenario", str(reclaim_only), "--script", str(script))
    try:
        code = play.process.wait(timeout=ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the demo went on for {ENDS_WITHIN:.0f}s after the script finished")
    finally:
        play.stop()
    stderr = play.stderr_path.read_text()
    assert code == 1, stderr
    said = (
        "your script finished (its ranks exited 0) without publishing a training step, "
        "before the scenario's event at 2s (reclaim)"
    )
    assert said in stderr and "train longer" in stderr, stderr
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert any(e["reason"] == "Completed" for e in events), events
    assert not any(e["reason"] == "NotSettled" for e in events), events


def test_the_demo_says_at_which_step_a_script_finished_and_which_events_it_did_not_reach(tmp_path: Path) -> None:
    run = RunState(load_scenario(resolve_scenario_path("short")), "regroup", RunLayout(tmp_path))
    run.recorder = JobRecorder(EtcdSettings.from_endpoint_string("127.0.0.1:2379"), JobKeys("default", "demo"),
                               *(tmp_path / f for f in ("p.jsonl", "m.jsonl", "plans.jsonl")))  # fmt: skip
    # The README's script with no arguments: 1024 samples, a global batch of 48, 3 epochs.
    run.recorder.view.progress = Progress(step=63, loss=0.5, samples_seen=63 * 48, world_size=3, time=time.time())
    assert finished_early(run, script=True) == (
        "your script finished (its ranks exited 0) at step 63, before the scenario's events at 6s (reclaim), "
        "24s (lose), 36s (restore) and 66s (flaky): train longer (more steps or epochs, in its arguments "
        "after --): the scenario plays for 92s once the job trains settled"
    )
    run.played = 3
    assert finished_early(run, script=False) == (
        "the job finished (its ranks exited 0) at step 63, before the scenario's event at 66s (flaky)"
    )
    run.played = 4
    assert finished_early(run, script=False).endswith("at step 63, before the scenario's end at 92s")
