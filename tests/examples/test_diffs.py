"""The examples stay what examples/README.md says they are: upstream files unchanged, and
converted scripts whose diffs (pasted there, with their counts) are those of the files."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
FSDP2_UPSTREAM = EXAMPLES / "fsdp2" / "upstream"
BLOBS = {
    # git blob ids at pytorch/examples 77f55b912142e11fcfdf5b530231fb9c52f181e8, distributed/FSDP2/
    "example.py": "abe0120a1d349757835071ed7323adc5990885b4",
    "model.py": "21b609615aaf79ba70b0e33f3cbc88e026e4d3ef",
    "utils.py": "402d2bf33dd4f7ff9f788757f761c76ceb8df174",
    "checkpoint.py": "aede91782338c75d402565a980a58a589a47b3d1",
    "README.md": "50a6dff9b4e68bbe6b52190ff7626e2a73ddb6e0",
}
GOAL = 20
"""Most changed lines for all of regroup against an upstream script (docs/your-script.md:
"about twenty changed lines"), CPU adaptations and upstream fixes included."""
CONVERSIONS = {
    # name: (folder, upstream, converted, most changed lines allowed: today's count, so
    # that a conversion does not grow unnoticed)
    "fsdp2": (EXAMPLES / "fsdp2", "upstream/example.py", "train.py", 19),
    "hf_llama": (EXAMPLES / "hf_llama", "upstream.py", "train.py", 9),
}
README = EXAMPLES / "README.md"


def _blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _diff(folder: Path, *args: str) -> str:
    return subprocess.run(["diff", *args], cwd=folder, capture_output=True, text=True).stdout


def test_the_upstream_files_are_byte_for_byte_upstream() -> None:
    assert {name: _blob_id(FSDP2_UPSTREAM / name) for name in BLOBS} == BLOBS
    assert "BSD 3-Clause License" in (FSDP2_UPSTREAM / "LICENSE").read_text()
    assert "77f55b912142e11fcfdf5b530231fb9c52f181e8" in (FSDP2_UPSTREAM / "NOTICE").read_text()
    for name in ("model.py", "utils.py", "checkpoint.py"):  # train.py imports them as example.py does
        link = EXAMPLES / "fsdp2" / name
        assert link.is_symlink() and link.resolve() == (FSDP2_UPSTREAM / name).resolve()


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_the_diff_is_small_and_the_readme_shows_it(name: str) -> None:
    folder, upstream, converted, ceiling = CONVERSIONS[name]
    lines = _diff(folder, upstream, converted).splitlines()
    removed = sum(1 for line in lines if line.startswith("<"))
    added = sum(1 for line in lines if line.startswith(">"))
    assert removed + added <= min(ceiling, GOAL), f"{name}: {removed + added} changed lines (at most {ceiling})"

    readme = README.read_text()
    row = re.search(rf"`{name}/train\.py` \| (\d+) \| (\d+) / (\d+) \| (\d+) \| (\d+) \|", readme)
    assert row, f"examples/README.md has no table row for {name}"
    total, shown_removed, shown_added, regroup, adaptations = map(int, row.groups())
    assert (total, shown_removed, shown_added) == (removed + added, removed, added)
    assert regroup + adaptations == total, f"{name}: the split in examples/README.md does not add up"
    shown = _diff(folder, "-u", "--label", upstream, "--label", converted, upstream, converted)
    assert f"```diff\n{shown}```" in readme, f"examples/README.md does not show the current diff of {name}"
