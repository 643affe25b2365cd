"""The README's "your script in twenty lines" diff runs as written: the converted script
trains to its end in a world of one, and the diff stays within twenty changed lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _readme_diff() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"^```diff\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) == 1, f"the README should hold one diff block, found {len(blocks)}"
    return blocks[0].splitlines()


def _side(lines: list[str], keep: str) -> str:
    return "\n".join(line[1:] for line in lines if line[:1] in (" ", keep) or line == "") + "\n"


def test_the_readme_diff_is_twenty_lines_at_most_and_both_sides_compile() -> None:
    lines = _readme_diff()
    changed = [line for line in lines if line[:1] in "+-"]
    assert 0 < len(changed) <= 20, f"{len(changed)} changed lines"
    compile(_side(lines, "-"), "README original", "exec")
    compile(_side(lines, "+"), "README converted", "exec")


def test_the_readme_converted_script_trains_to_its_end(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_side(_readme_diff(), "+"))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={"PATH": "/usr/bin:/bin", "REGROUP_LOG_EVERY": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # 1024 samples, a global batch of 48, 3 epochs: 3 x 21 = 63 steps, the last one logged.
    assert '"step": 63' in done.stderr or "step=63" in done.stderr, done.stderr[-3000:]
