"""``regroup demo --script``: the training command, the workers' environment, and the
analysis and report of a run whose script reports less than the built-in trainer."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from regroup.demo.analysis import continuity_errors, event_impacts, incarnations, interruptions, load_run
from regroup.demo.nodes import (
    RunLayout,
    ScriptError,
    make_launcher,
    torchrun_argv,
    worker_command,
)
from regroup.demo.report import build_report, not_reported, summary_text
from regroup.demo.scenario import load_scenario, resolve_scenario_path
from regroup.elastic.options import options
from regroup.rendezvous.inplace.launcher import export_etcd
from tests.demo.recorded import EVENTS, T0, write_run


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def test_a_script_and_its_arguments_follow_torchruns_flags(script: Path, tmp_path: Path) -> None:
    assert worker_command("train.py", ["--lr", "3e-4"], cwd=tmp_path) == [str(script), "--lr", "3e-4"]
    assert worker_command(None, ["python", "train.py", "--lr", "3e-4"], cwd=tmp_path) == [str(script), "--lr", "3e-4"]
    assert worker_command(None, ["python3.11", "train.py"], cwd=tmp_path) == [str(script)]
    assert worker_command(None, ["python", "-m", "pkg.train", "-x"], cwd=tmp_path) == ["-m", "pkg.train", "-x"]
    assert worker_command(None, ["./run.sh", "a"], cwd=tmp_path) == ["--no-python", "./run.sh", "a"]
    scenario = load_scenario(resolve_scenario_path("short"))
    argv = torchrun_argv(scenario, "regroup", "127.0.0.1:2379", None, worker=[str(script), "--lr", "1"])
    assert argv[argv.index("--rdzv-backend=etcd-v3") + 1 :] == [str(script), "--lr", "1"]
    assert "--standby" in argv


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("missing.py", [], "missing.py: no such script"),
        (None, [], "no training command"),
        (None, ["python"], "no script to run"),
        (None, ["python", "-u", "train.py"], "python option -u is not supported"),
        (None, ["torchrun", "train.py"], "the demo starts the agents itself"),
        (None, ["-m"], "no module named"),
    ],
)
def test_a_command_the_demo_cannot_run_is_refused_with_the_reason(
    script: str | None, args: list[str], says: str, tmp_path: Path
) -> None:
    with pytest.raises(ScriptError, match=re.escape(says)):
        worker_command(script, args, cwd=tmp_path)


@pytest.mark.parametrize("mode", ["regroup", "regroup-restart", "torchrun-c10d"])
def test_every_worker_finds_the_runs_etcd_checkpoints_and_sample_logs(mode: str, script: Path, tmp_path: Path) -> None:
    scenario = load_scenario(resolve_scenario_path("short"))
    layout = RunLayout(tmp_path / "run")
    rdzv = "127.0.0.1:29400" if mode == "torchrun-c10d" else "127.0.0.1:2379"
    launch = make_launcher(scenario, mode, layout, rdzv, None, worker=[str(script)], etcd_endpoint="127.0.0.1:2379")  # type: ignore[arg-type]
    command = launch("node-1", "node-1-worker", 0)
    assert command.env["REGROUP_ETCD_ENDPOINT"] == "127.0.0.1:2379"
    assert command.env["REGROUP_CHECKPOINT_DIR"] == str(layout.checkpoints)
    assert command.env["REGROUP_SAMPLE_LOG"] == str(layout.samples)
    assert command.env["REGROUP_SPANS_FILE"] == str(layout.spans)
    assert command.argv[-1] == str(script) and "regroup.trainer" not in command.argv


def test_regroup_run_exports_the_rendezvous_etcd_to_workers_that_have_none() -> None:
    env: dict[str, str] = {}
    assert export_etcd("etcd-v3", "etcd-0:2379,etcd-1:2379", "", env) == ["REGROUP_ETCD_ENDPOINT"]
    assert env == {"REGROUP_ETCD_ENDPOINT": "etcd-0:2379,etcd-1:2379"}
    mine = {"REGROUP_ETCD_ENDPOINT": "other:2379"}
    assert not export_etcd("etcd-v3", "etcd-0:2379", "", mine) and mine["REGROUP_ETCD_ENDPOINT"] == "other:2379"
    c10d: dict[str, str] = {}
    assert not export_etcd("c10d", "host:29400", "cert=/x", c10d) and not c10d


def test_regroup_run_hands_its_etcd_identity_to_the_workers_and_rank_0_connects_as_it() -> None:
    env = {"REGROUP_ETCD_KEY": "/mine/key.pem"}
    conf = "cacert=/tls/ca.crt,cert=/tls/tls.crt,key=/tls/tls.key,lease_ttl=5"
    assert export_etcd("etcd-v3", "etcd:2379", conf, env) == [
        "REGROUP_ETCD_ENDPOINT", "REGROUP_ETCD_CACERT", "REGROUP_ETCD_CERT"
    ]  # fmt: skip
    assert env["REGROUP_ETCD_CERT"] == "/tls/tls.crt" and env["REGROUP_ETCD_KEY"] == "/mine/key.pem"
    # The workers' settings take the files from there, as they take the endpoint.
    etcd = options({**env, "TORCHELASTIC_RUN_ID": "job"}, global_batch=4, max_steps=1).etcd
    assert etcd is not None
    assert (etcd.cacert, etcd.cert, etcd.key) == ("/tls/ca.crt", "/tls/tls.crt", "/mine/key.pem")


def _script_rows(stretches: list[tuple[int, int, float, int, int]], loss: bool = True) -> list[dict[str, object]]:
    """(first step, last step, start second, world size, round) -> what a script that reports
    no resume point (and maybe no loss) publishes: step, loss, world_size, samples_seen, time."""
    rows = []
    for first, last, start, world, round_ in stretches:
        for i, step in enumerate(range(first, last + 1)):
            t = T0 + start + i * 0.5
            rows.append(
                {"seen": t, "time": t, "step": step, "loss": 5.0 / (1 + step / 20) if loss else 0.0,
                 "world_size": world, "samples_seen": step * 12, "round": round_}
            )  # fmt: skip
    return rows


def _script_run(root: Path, loss: bool = True) -> Path:
    # Reclaim: re-formed in place (new round, steps go on); loss: back to the checkpoint at 40
    # after 47; grow: in place again.
    rows = _script_rows([(1, 20, 0.0, 3, 1), (21, 47, 15.0, 2, 2), (41, 60, 35.0, 1, 3), (61, 80, 52.0, 3, 4)], loss)
    write_run(root, "regroup", rows, EVENTS, 75.0)
    meta = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**meta, "script": ["/home/me/train.py", "--lr", "3e-4"]}))
    return root


def test_a_scripts_resume_points_are_inferred_from_its_steps(tmp_path: Path) -> None:
    run = load_run(_script_run(tmp_path / "run"))
    assert [(i.first_step, i.resumed_from_step) for i in incarnations(run.progress)] == [(1, 0), (21, 20), (41, 40), (61, 60)]
    assert [s.lost_steps for s in interruptions(run.progress)] == [0, 7, 0]
    assert [(i.event.reason, i.lost_steps) for i in event_impacts(run)] == [
        ("reclaim", 0), ("lose", 7), ("restore", 0), ("flaky", 0),
    ]  # fmt: skip
    assert continuity_errors(run.progress) == []
    assert run.reported == {"loss": True, "resumed_from_step": False, "reform_mode": False, "resume_phases": False}


def test_the_report_of_a_script_says_what_it_did_not_report(tmp_path: Path) -> None:
    run = load_run(_script_run(tmp_path / "run", loss=False))
    assert not_reported(run) == [
        "loss", "resume points (resumed_from_step)", "re-form mode (reform_mode)", "resume split (resume_phases)",
    ]  # fmt: skip
    text = build_report([run], tmp_path / "run" / "report.html").read_text()
    assert "Loss: not reported by this script." in text
    assert "Resume points: not reported by this script" in text
    assert "/home/me/train.py --lr 3e-4" in text
    summary = summary_text([run], tmp_path / "run" / "report.html")
    assert "script: /home/me/train.py --lr 3e-4" in summary and "not reported by this script (regroup): loss" in summary


def test_a_nan_loss_is_left_out_of_the_chart_not_a_crash(tmp_path: Path) -> None:
    root = _script_run(tmp_path / "run")
    rows = [json.loads(line) for line in (root / "progress.jsonl").read_text().splitlines()]
    rows[5]["loss"] = math.nan
    (root / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(root)
    assert "Loss vs step" in build_report([run], root / "report.html").read_text()
    assert not_reported(run)[0] == "resume points (resumed_from_step)"


def test_a_script_that_never_resumed_is_not_said_to_leave_out_its_resume_points(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_run(root, "torchrun-c10d", _script_rows([(1, 30, 0.0, 3, 0)]), EVENTS[:1], 75.0)
    meta = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**meta, "script": ["train.py"]}))
    run = load_run(root)
    assert not_reported(run) == []
    assert "not reported" not in summary_text([run], root / "report.html")
