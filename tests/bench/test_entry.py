"""``python -m bench NAME``, the one way to start a benchmark: its ``--help`` lists every
benchmark (each module and package of ``bench`` not named ``_*``) with a line each, each
benchmark's ``--help`` exits 0 without running anything, and no benchmark starts another way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import main

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
NAMES = sorted(
    p.stem if p.is_file() else p.name
    for p in BENCH.iterdir()
    if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists())
)


def test_help_lists_every_benchmark_with_a_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr
    listed = [line.split(None, 1) for line in result.stdout.split("benchmarks:\n", 1)[1].splitlines()]
    assert [row[0] for row in listed] == NAMES
    assert all(len(row) == 2 and row[1].strip() for row in listed), listed


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_help_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {name} ")


@pytest.mark.parametrize("name", NAMES)
def test_no_benchmark_starts_another_way(name: str) -> None:
    """No ``python -m bench.NAME`` or ``python bench/NAME.py``: the modules the benchmarks
    spawn (``_*.py``, and the helpers inside a package) are not benchmarks."""
    entry = BENCH / f"{name}.py" if (BENCH / f"{name}.py").exists() else BENCH / name / "__init__.py"
    assert '__name__ == "__main__"' not in entry.read_text()
    assert not (BENCH / name / "__main__.py").exists()


@pytest.mark.parametrize("argv", [[], ["no-such-benchmark"]])
def test_no_or_unknown_name_exits_2_with_the_list(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(f"\n  {name} " in err for name in NAMES), err
