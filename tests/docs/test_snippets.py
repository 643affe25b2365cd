"""The docs' code runs as written: every fenced block of README.md, docs/**/*.md and
examples/README.md is found at test time and checked by its kind (tests/docs/snippets.py),
so is every inline code span of their prose that is a command line (`regroup status --job
<name>`, `make bench ARGS="chaos"`), and every relative link resolves. A renamed flag,
subcommand, module or API name fails here, naming the file and line, rather than failing a
reader.

A block opts out with ``# not-tested: <reason>`` as its first line; few may.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pytest

from tests.docs.markdown import REPO, Block, Span, code_spans, doc_files, fenced_blocks
from tests.docs.pycode import api_module
from tests.docs.snippets import doc_checker, inline_command, kind_of

MAX_OPT_OUTS = 3

DOCS = {str(path.relative_to(REPO)): path.read_text() for path in doc_files()}
BLOCKS = [block for path, text in DOCS.items() for block in fenced_blocks(text, path)]
CHECKED = [block for block in BLOCKS if kind_of(block) != "other"]
INLINE = {path: [span for span in code_spans(text, path) if inline_command(span.text)] for path, text in DOCS.items()}


@pytest.mark.parametrize("block", CHECKED, ids=str)
def test_code_block(block: Block) -> None:
    problems = doc_checker().check_block(block)
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("path", sorted(DOCS))
def test_inline_commands(path: str) -> None:
    """Commands written inline in the prose, checked as a line of a bash block is."""
    problems = [problem for span in INLINE[path] for problem in doc_checker().check_span(span)]
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("path", sorted(DOCS))
def test_links(path: str) -> None:
    problems = doc_checker().check_links(DOCS[path], path)
    assert not problems, "\n".join(map(str, problems))


def test_opt_outs_are_few_and_each_says_why() -> None:
    opted = [block for block in BLOCKS if block.opt_out is not None]
    assert len(opted) <= MAX_OPT_OUTS, "blocks opted out of these checks: " + ", ".join(map(str, opted))
    assert all(block.opt_out for block in opted), "an opt-out needs a reason: " + ", ".join(
        str(b) for b in opted if not b.opt_out
    )


def test_the_docs_hold_code_that_is_checked() -> None:
    """Guards the discovery itself: a fence the parser misses would check nothing, silently."""
    checker = doc_checker()
    kinds = {kind_of(block) for block in CHECKED}
    assert "shell" in kinds and kinds & {"python", "diff"}, f"kinds found: {sorted(kinds)}"
    project_commands = [
        command
        for block in CHECKED
        if kind_of(block) in ("shell", "plain")
        for command in checker.shell_commands(block, kind_of(block) == "shell")[0]
        if command.words and re.search(r"(^|/)(regroup[\w-]*|torchrun|make|python3?)$", command.words[0])
    ]
    assert len(project_commands) >= 5, f"only {len(project_commands)} project commands found in the docs"
    inline = [span for spans in INLINE.values() for span in spans]
    assert len(inline) >= 50, f"only {len(inline)} inline commands found in the docs: " + ", ".join(map(str, inline))


def test_the_public_api_is_regroup_elastic_and_its_earlier_name_still_imports_with_a_warning() -> None:
    api = api_module()
    assert api.__name__ == "regroup.elastic"
    assert callable(api.Run)
    sys.modules.pop("regroup.trainer.elastic", None)
    with pytest.warns(DeprecationWarning, match="from regroup import elastic"):
        from regroup.trainer import elastic as earlier
    assert earlier is api


# --- the checker finds what it should ----------------------------------------------------

SYNTHETIC = '''# Synthetic

```bash
regroup demo --no-such-flag 3
python -m regroup.no_such_module --quick
make bench ARGS="no-such-bench"
torchrun --rdzv-backend=etcd-v3 --rdzv-conf=lease_ttl=5,no_such_key=1 --nnodes=1:2 \\
         -m regroup.trainer --config t.yaml --no-such-trainer-flag
```

```python
import regroup.no_such_module

for step in elastic.Run(model, optimizer, global_batch=8, max_steps=10, no_such_setting=1):
    step.no_such_method()
elastic.no_such_name
```

```yaml
model: {dim: -1}
```

```yaml
metadata:
  annotations:
    regroup.dev/min-nodes: "two"
```

[broken](no-such-file.md) and [bad anchor](#no-such-heading), [good anchor](#synthetic)

Inline, `regroup status --no-such-inline-flag` and `make bench ARGS="no-such-inline-bench"`; a
span over a line break, `regroup-run --standby
--no-such-wrapped-flag`; not commands: `regroup`, `regroup:job:<ns>:<job>`,
`regroup status: etcd denied range`, `--rdzv-conf no_such_fragment=1`.
'''


def _line(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.split("\n"), 1) if needle in line)


@pytest.mark.parametrize(
    "needle, message",
    [
        ("--no-such-flag", "regroup demo: no option --no-such-flag"),
        ("regroup.no_such_module --quick", "no module named 'regroup.no_such_module'"),
        ("no-such-bench", "no benchmark 'no-such-bench'"),
        ("no_such_key=1", "no_such_key"),
        ("--no-such-trainer-flag", "no option --no-such-trainer-flag"),
        ("import regroup.no_such_module", "import regroup.no_such_module"),
        ("no_such_setting=1", "takes no keyword argument 'no_such_setting'"),
        ("step.no_such_method", "has no attribute 'no_such_method'"),
        ("elastic.no_such_name", "has no attribute 'no_such_name'"),
        ("model: {dim: -1}", "model.dim"),
        ("regroup.dev/min-nodes", "not a whole number"),
        ("[broken]", "no such file docs/no-such-file.md"),
        ("[bad anchor]", "#no-such-heading"),
        ("--no-such-inline-flag", "regroup status: no option --no-such-inline-flag"),
        ("no-such-inline-bench", "no benchmark 'no-such-inline-bench'"),
        ("regroup-run --standby", "no option --no-such-wrapped-flag"),
    ],
)
def test_the_checker_reports_each_mistake_at_its_line(needle: str, message: str) -> None:
    problems = doc_checker().check_markdown(SYNTHETIC, "docs/synthetic.md")
    line = _line(SYNTHETIC, needle)
    at_line = [str(p) for p in problems if p.line == line]
    assert any(message in p for p in at_line), f"expected {message!r} at docs/synthetic.md:{line}; got:\n" + "\n".join(
        map(str, problems)
    )
    assert all(p.path == "docs/synthetic.md" for p in problems)


def test_the_checker_reports_nothing_else_in_the_synthetic_doc() -> None:
    problems = doc_checker().check_markdown(SYNTHETIC, "docs/synthetic.md")
    assert not [p for p in problems if "#synthetic" in p.message], "a heading's own anchor was refused"
    not_commands = _line(SYNTHETIC, "not commands:")
    assert not [p for p in problems if p.line >= not_commands], "a span that is no command was checked"
    assert len(problems) <= 19, "\n".join(map(str, problems))


def test_renaming_a_documented_flag_fails_at_its_file_and_line() -> None:
    """The docs as they are, one project flag renamed in a copy of its block: caught, located."""
    checker = doc_checker()
    for block in CHECKED:
        if kind_of(block) != "shell":
            continue
        before = {str(p) for p in checker.check_block(block)}
        for offset, line in enumerate(block.body):
            match = re.search(r"^\s*(?:\S*/)?(?:regroup(?:-run)?|torchrun)\s.*?\s(--[a-z][\w-]+)", line.split(" #")[0])
            if not match:
                continue
            flag = match.group(1)
            body = list(block.body)
            body[offset] = line[: match.start(1)] + flag + "-renamed" + line[match.end(1) :]
            after = [p for p in checker.check_block(replace(block, body=tuple(body))) if str(p) not in before]
            assert after, f"renaming {flag} at {block.path}:{block.first_line + offset} went unnoticed"
            assert any(
                p.path == block.path and p.line == block.first_line + offset and f"{flag}-renamed" in p.message for p in after
            ), "\n".join(map(str, after))
            return
    raise AssertionError("no shell block of the docs holds a flag of regroup, regroup-run or torchrun")


def test_renaming_a_flag_written_inline_fails_at_its_file_and_line() -> None:
    """The same for a command written inline in the prose: one flag renamed in its span."""
    checker = doc_checker()
    renamed = 0
    for path, spans in sorted(INLINE.items()):
        for span in spans:
            project = re.match(r"(?:\S*/)?(?:regroup(?:-run)?\s|torchrun\s|make\s|python3?\s+-m\s*(?:bench|regroup)\b)", span.text)
            match = re.search(r"\s(--[a-z][\w-]+)", span.text)
            if not project or not match or checker.check_span(span):
                continue
            flag = match.group(1)
            text = span.text[: match.start(1)] + flag + "-renamed" + span.text[match.end(1) :]
            after = checker.check_span(replace(span, text=text))
            assert any(
                p.path == path and p.line == span.line and f"{flag}-renamed" in p.message for p in after
            ), f"renaming {flag} in {span} went unnoticed: " + "\n".join(map(str, after))
            renamed += 1
    assert renamed >= 10, f"only {renamed} inline commands of the docs hold a flag"
