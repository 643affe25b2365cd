"""The demo runs the tests read, each played once per session: the short scenario with the
built-in trainer (``short_run``), and its first 52 s with PyTorch's FSDP2 example as the
training script (``script_run``, tests/demo/test_demo_script.py).

The demo spends most of its time waiting for the scenario's next event: on 2 idle cores it
keeps about half a core busy. So the runs the session's tests use all start together with
the first test of this folder, the folder's other tests run while they play (the tests
that read a run come after them), and each run's fixture waits for its run's end. Each run
waits for its job to settle before every event, as on any busy machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from regroup.demo.analysis import RunData, load_run
from tests.demo.demo_runs import DemoPlay, first_part_of_short, script_command
from tests.scratch import scratch

PLAYS: dict[str, Callable[[Path], list[str]]] = {
    "short_run": lambda out: ["--scenario", "short"],
    "script_run": lambda out: ["--scenario", str(first_part_of_short(out)), *script_command()],
}
"""Fixture name -> the ``regroup demo`` arguments of its run (given the run's folder)."""


class Plays:
    """The session's demo runs, by fixture name; one asked for that was not started yet
    starts then."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._plays: dict[str, DemoPlay] = {}

    def start(self, name: str) -> DemoPlay:
        if name not in self._plays:
            out = self._root / name.replace("_", "-")
            out.mkdir()
            self._plays[name] = DemoPlay(out, *PLAYS[name](out))
        return self._plays[name]

    def stop(self) -> None:
        for play in self._plays.values():  # a run nobody waited for (its tests failed first) ends here
            play.stop()


def _reads_a_run(item: pytest.Item) -> bool:
    return any(name in PLAYS for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within this folder's tests, those that read a demo run go last (in their order)."""
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if item.path.parent == here]
    ordered = sorted((items[i] for i in mine), key=_reads_a_run)  # stable: the others keep their order
    for i, item in zip(mine, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="package", autouse=True)
def demo_plays(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plays]:
    """Every run of ``PLAYS`` that a test of this session uses, started at once with the
    first test of this folder; their folders go with this folder's last test."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in PLAYS}
    with scratch(request, tmp_path_factory, "demo") as root:
        plays = Plays(root)
        try:
            for name in sorted(used):
                plays.start(name)
            yield plays
        finally:
            plays.stop()


@pytest.fixture(scope="package")
def short_run(demo_plays: Plays) -> RunData:
    """``regroup demo --scenario short`` to its end (about 2 minutes on 2 idle cores)."""
    play = demo_plays.start("short_run")
    stdout = play.finish()
    run_dir = play.out / "run"
    assert (run_dir / "report.html").is_file()
    assert f"report: {run_dir.resolve() / 'report.html'}" in stdout
    return load_run(run_dir)


@pytest.fixture(scope="package")
def script_run(demo_plays: Plays) -> tuple[RunData, str]:
    """``regroup demo --script`` on the short scenario's first 52 s, to its end."""
    play = demo_plays.start("script_run")
    stdout = play.finish()
    return load_run(play.out / "run"), stdout
