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
MINGPT_UPSTREAM = EXAMPLES / "mingpt" / "upstream"
MINGPT_BLOBS = {
    # git blob ids at the same commit, distributed/minGPT-ddp/mingpt/ (README.md: distributed/minGPT-ddp/)
    "main.py": "8fdca566675543e91b791d46f68b66fbe7923e35",
    "trainer.py": "1fbc4570605ed62dc88e5041c5d44f99f1abc777",
    "model.py": "2d2e0f8cd155fb27b76f63b4e90a702be6dec35d",
    "char_dataset.py": "38a638dfc685ba8fddefd0b1b021c2f16c0a520e",
    "gpt2_train_cfg.yaml": "38805f37e3bc792ede7d14a39396cf4a8c18562e",
    "README.md": "ab6145f218db297ab3829db7dd29ac358b8000d1",
}
GOAL = 20
"""Most changed lines for regroup's part of a conversion (docs/your-script.md: "about twenty
changed lines"); the first two conversions meet it with their CPU adaptations included."""
CONVERSIONS = {
    # name: (folder, [(upstream, converted), ...], most changed lines allowed in all: today's
    # count, so that a conversion does not grow unnoticed)
    "fsdp2": (EXAMPLES / "fsdp2", [("upstream/example.py", "train.py")], 19),
    "hf_llama": (EXAMPLES / "hf_llama", [("upstream.py", "train.py")], 9),
    "mingpt": (EXAMPLES / "mingpt", [("upstream/main.py", "main.py"), ("upstream/trainer.py", "trainer.py")], 30),
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
    assert {name: _blob_id(MINGPT_UPSTREAM / name) for name in MINGPT_BLOBS} == MINGPT_BLOBS
    assert "BSD 3-Clause License" in (MINGPT_UPSTREAM / "LICENSE").read_text()
    assert "77f55b912142e11fcfdf5b530231fb9c52f181e8" in (MINGPT_UPSTREAM / "NOTICE").read_text()
    for name in ("model.py", "char_dataset.py", "gpt2_train_cfg.yaml"):  # imported and configured as upstream's
        link = EXAMPLES / "mingpt" / name
        assert link.is_symlink() and link.resolve() == (MINGPT_UPSTREAM / name).resolve()


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_the_diff_is_small_and_the_readme_shows_it(name: str) -> None:
    folder, files, ceiling = CONVERSIONS[name]
    lines = [line for upstream, converted in files for line in _diff(folder, upstream, converted).splitlines()]
    removed = sum(1 for line in lines if line.startswith("<"))
    added = sum(1 for line in lines if line.startswith(">"))
    assert removed + added <= ceiling, f"{name}: {removed + added} changed lines (at most {ceiling})"

    readme = README.read_text()
    last = files[-1][1]
    row = re.search(rf"`{name}/{re.escape(last)}` \| (\d+) \| (\d+) / (\d+) \| (\d+) \| (\d+) \|", readme)
    assert row, f"examples/README.md has no table row for {name}"
    total, shown_removed, shown_added, regroup, adaptations = map(int, row.groups())
    assert (total, shown_removed, shown_added) == (removed + added, removed, added)
    assert regroup + adaptations == total, f"{name}: the split in examples/README.md does not add up"
    assert regroup <= GOAL, f"{name}: {regroup} lines of regroup (the goal is at most {GOAL})"
    for upstream, converted in files:
        shown = _diff(folder, "-u", "--label", upstream, "--label", converted, upstream, converted)
        assert f"```diff\n{shown}```" in readme, f"examples/README.md does not show the current diff of {name}/{converted}"
