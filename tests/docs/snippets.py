"""Every code block a user runs from the docs, checked by kind; and the docs' links.

- ``python``: parses; project imports resolve; attributes and call keywords exist (pycode).
- ``diff`` (of .py files): the same, line by line, on the new side.
- ``bash``/``sh``/``console`` and unlabeled blocks: the project's commands are checked
  against their real parsers (commands); an unlabeled block's lines are checked only where
  they read as one of the project's commands (the rest is output or a diagram).
- ``yaml``: parses; a trainer config is validated by the trainer's loader, a demo scenario by
  the demo's parser, ``regroup.dev/`` annotations by the controller's parser, and a container
  ``command:`` as a command line. ``json``/``toml``: parse.
- Inline code spans of the prose that are command lines (``regroup ...``, ``regroup-run
  ...``, ``torchrun ...``, ``make ...``, ``python ...``, ``kubectl ...``, ``pip ...``: a
  program named with at least one argument): checked as a line of a ``bash`` block is
  (``inline_command``).
- Links: relative links resolve to a file of the repository; ``#anchors`` into a markdown
  file match one of its headings (GitHub's slugs).

A block opts out with ``# not-tested: <reason>`` as its first line.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import fields, is_dataclass
import re
import textwrap
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from tests.docs.commands import Command, CommandChecker, is_placeholder, split_commands, strip_prefixes, unwrap_synopsis
from tests.docs.markdown import REPO, Block, Problem, Span, anchors, code_spans, fenced_blocks, links
from tests.docs.pycode import PythonChecker, config_loading_module

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console", "zsh", "shell-session", "shellsession"}
YAML = {"yaml", "yml"}
DIFF = {"diff", "patch"}
SCENARIO_KEYS = {"name", "nodes", "duration", "job", "events", "trainer"}


def kind_of(block: Block) -> str:
    """python, shell, yaml, diff, json, toml, plain (unlabeled) or other (not checked)."""
    if block.lang in PYTHON:
        return "python"
    if block.lang in SHELL:
        return "shell"
    if block.lang in YAML:
        return "yaml"
    if block.lang in DIFF:
        return "diff"
    if block.lang in ("json", "toml"):
        return block.lang
    return "plain" if not block.lang else "other"


@cache
def _known_annotation_strings() -> frozenset[str]:
    """Every ``regroup.dev/...`` string the shipped code mentions (labels and annotations)."""
    found: set[str] = set()
    for root, _, files in os.walk(REPO / "regroup", followlinks=True):
        for file in files:
            if file.endswith(".py"):
                text = open(os.path.join(root, file), encoding="utf-8").read()
                found.update(re.findall(r"regroup\.dev/[a-z0-9-]+", text))
    return frozenset(found)


class DocChecker:
    def __init__(self) -> None:
        self.commands = CommandChecker()
        self.python = PythonChecker()

    # Whole markdown texts.

    def check_markdown(self, text: str, path: str) -> list[Problem]:
        problems: list[Problem] = []
        for block in fenced_blocks(text, path):
            problems += self.check_block(block)
        for span in code_spans(text, path):
            problems += self.check_span(span)
        problems += self.check_links(text, path)
        return problems

    # Inline code spans.

    def check_span(self, span: Span) -> list[Problem]:
        """An inline span that is one of the project's command lines, checked as a one-line
        ``bash`` block at the span's line; any other span is not code a reader runs."""
        if not inline_command(span.text):
            return []
        return self.check_block(Block(span.path, span.line - 1, "bash", (span.text,)))

    # Blocks.

    def check_block(self, block: Block) -> list[Problem]:
        problems: list[Problem] = []

        def at(line: int, message: str) -> None:
            problems.append(Problem(block.path, line, message))

        reason = block.opt_out
        if reason is not None:
            if not reason:
                at(block.line, "opted out with no reason: write '# not-tested: <reason>'")
            return problems
        kind = kind_of(block)
        if kind == "python":
            self.python.check_block(block.body, block.first_line, at)
        elif kind == "diff":
            headers = [line[4:].split()[0] for line in block.body if line.startswith("+++ ") and line[4:].split()]
            if not headers or any(h.endswith(".py") for h in headers):
                self.python.check_diff(list(block.body), block.first_line, at)
        elif kind in ("shell", "plain"):
            self.check_shell(block, at, labeled=kind == "shell")
        elif kind == "yaml":
            self.check_yaml(block, at)
        elif kind == "json":
            try:
                json.loads("\n".join(block.body))
            except ValueError as exc:
                at(block.first_line + getattr(exc, "lineno", 1) - 1, f"not valid JSON: {exc}")
        elif kind == "toml":
            try:
                tomllib.loads("\n".join(block.body))
            except tomllib.TOMLDecodeError as exc:
                at(block.first_line, f"not valid TOML: {exc}")
        return problems

    # Shell.

    def shell_commands(self, block: Block, labeled: bool) -> tuple[list[Command], list[tuple[int, str]]]:
        """The block's logical lines as commands, and (line, reason) for lines that do not split."""
        console = any(re.match(r"^\s*\$ ", line) for line in block.body)
        logical: list[list[tuple[int, str]]] = []
        continuing = False
        for offset, raw in enumerate(block.body):
            number = block.first_line + offset
            text = raw
            if console and not continuing:
                prompt = re.match(r"^\s*\$ (.*)$", raw)
                if not prompt:
                    continue
                text = prompt.group(1)
            synopsis = (
                not labeled
                and logical
                and re.match(r"^\s+[\[-]", raw)
                and not continuing
                and self._is_command_start(logical[-1][0][1])
            )
            if continuing or synopsis:
                logical[-1].append((number, text))
            else:
                logical.append([(number, text)])
            continuing = text.rstrip().endswith("\\")
        commands: list[Command] = []
        unsplit: list[tuple[int, str]] = []
        for physical in logical:
            text = " ".join(t.rstrip().removesuffix("\\") for _, t in physical)
            text = unwrap_synopsis(text)
            try:
                split = split_commands(text)
            except ValueError as exc:
                unsplit.append((physical[0][0], f"cannot split into words: {exc}"))
                continue
            commands += [Command(words, physical) for words in split]
        return commands, unsplit

    def _is_command_start(self, text: str) -> bool:
        try:
            words = strip_prefixes(split_commands(unwrap_synopsis(text))[0])
        except (ValueError, IndexError):
            return False
        return bool(words) and self.commands.is_checked_program(words[0]) and not _reads_as_output(words)

    def check_shell(self, block: Block, at: Callable[[int, str], None], labeled: bool) -> None:
        commands, unsplit = self.shell_commands(block, labeled)
        if labeled:
            for line, reason in unsplit:
                at(line, reason)
        for command in commands:
            words = strip_prefixes(command.words)
            if not words:
                continue
            if labeled and words[0].startswith("-") and not is_placeholder(words[0]):
                at(command.lines[0][0], f"a command cannot start with {words[0]!r}: is a '\\' missing on the line before?")
                continue
            if not self.commands.is_checked_program(words[0]) or (not labeled and _reads_as_output(words)):
                continue
            self.commands.check(command.words, lambda message, needle, c=command: at(c.line_of(needle), message))

    # YAML.

    def check_yaml(self, block: Block, at: Callable[[int, str], None]) -> None:
        text = textwrap.dedent("\n".join(block.body))
        try:
            documents = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at(block.first_line + (mark.line if mark else 0), f"not valid YAML: {exc}")
            return

        def locate(needle: str) -> int:
            for offset, line in enumerate(block.body):
                if needle and needle in line:
                    return block.first_line + offset
            return block.first_line

        for document in documents:
            self._yaml_kind_checks(document, at, locate)
            self._yaml_walk(document, None, at, locate)

    def _yaml_kind_checks(self, document: Any, at: Callable[[int, str], None], locate: Callable[[str], int]) -> None:
        if not isinstance(document, dict) or not document:
            return
        if _is_trainer_config(document, config_loading_module().TrainConfig):
            self._trainer_config(document, at, locate, "trainer config")
        elif set(document) <= SCENARIO_KEYS and set(document) & {"nodes", "duration", "events"}:
            from regroup.demo.scenario import ScenarioError, parse_scenario

            body = {"nodes": 4, "duration": "1m", **document}
            try:
                parse_scenario(body)
            except ScenarioError as exc:
                at(locate(str(exc).split(":")[0].split("[")[0].split(".")[-1]), f"demo scenario: {exc}")
            if isinstance(document.get("trainer"), dict):
                self._trainer_config(document["trainer"], at, locate, "demo scenario trainer:")

    def _trainer_config(
        self, data: dict[str, Any], at: Callable[[int, str], None], locate: Callable[[str], int], what: str
    ) -> None:
        loading = config_loading_module()
        try:
            loading.config_from_dict(data)
        except Exception as exc:  # ConfigError, or whatever else the loader refuses with
            field = str(exc).split(":")[0].split(".")[-1].split("[")[0]
            at(locate(field + ":"), f"{what} refused by {loading.__name__}.config_from_dict: {exc}")

    def _yaml_walk(self, node: Any, parent: str | None, at: Callable[[int, str], None], locate: Callable[[str], int]) -> None:
        if isinstance(node, dict):
            keys = [k for k in node if isinstance(k, str) and k.startswith("regroup.dev/")]
            if keys and not _is_label_map(parent):
                self._annotations({k: node[k] for k in keys}, at, locate)
            elif keys:
                for key in keys:
                    if not isinstance(node[key], str):
                        at(locate(key), f"label {key}: Kubernetes takes strings only; quote {node[key]!r}")
            command = node.get("command")
            if isinstance(command, list) and command and all(isinstance(w, (str, int, float)) for w in command):
                words = [str(w) for w in command]
                extra = node.get("args")
                if isinstance(extra, list):
                    words += [str(w) for w in extra]
                if self.commands.is_checked_program(words[0]):
                    self.commands.check(words, lambda message, needle: at(locate(needle), message))
            for key, value in node.items():
                self._yaml_walk(value, key if isinstance(key, str) else None, at, locate)
        elif isinstance(node, list):
            for item in node:
                self._yaml_walk(item, parent, at, locate)

    def _annotations(self, found: dict[str, Any], at: Callable[[int, str], None], locate: Callable[[str], int]) -> None:
        """Pod annotations, as the controller parses them (a snippet may show only some)."""
        from regroup.controller import jobconfig
        from regroup.controller.settings import JobDefaults

        strings: dict[str, str] = {}
        for key, value in found.items():
            if not isinstance(value, str):
                at(locate(key), f"annotation {key}: Kubernetes takes strings only; quote {value!r}")
                value = str(value)
            strings[key] = value
            if key not in jobconfig.ANNOTATIONS and key not in _known_annotation_strings():
                at(locate(key), f"annotation {key}: no such regroup annotation (known: {', '.join(jobconfig.ANNOTATIONS)})")
        baseline = {jobconfig.MIN_NODES: "1", jobconfig.MAX_NODES: "1000000"}
        result = jobconfig.parse_pod_config({**baseline, **strings}, JobDefaults())
        if isinstance(result, list):
            for annotation, reason in result:
                at(locate(annotation), f"annotation {annotation}: {reason} (the controller's parse_pod_config)")

    # Links.

    def check_links(self, text: str, path: str) -> list[Problem]:
        problems: list[Problem] = []
        here = REPO / path
        for number, target in links(text):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue
            target_path, _, anchor = target.partition("#")
            target_path = unquote(target_path.split("?")[0])
            if not target_path:
                file, file_text = here, text
            else:
                base = REPO if target_path.startswith("/") else here.parent
                file = Path(os.path.normpath(base / target_path.lstrip("/")))
                file_text = None
                if file != REPO and REPO not in file.parents:
                    problems.append(Problem(path, number, f"link {target}: points outside the repository"))
                    continue
                if not file.exists():
                    problems.append(Problem(path, number, f"link {target}: no such file {file.relative_to(REPO)}"))
                    continue
            if anchor and file.suffix == ".md" and (file_text is not None or file.is_file()):
                offered = anchors(file_text if file_text is not None else file.read_text())
                if unquote(anchor).lower() not in {a.lower() for a in offered}:
                    where = "this file" if file_text is not None else str(file.relative_to(REPO))
                    problems.append(Problem(path, number, f"link {target}: no heading of {where} has the anchor #{anchor}"))
        return problems


def _is_trainer_config(document: dict[Any, Any], config: type) -> bool:
    """All its keys are the trainer config's; a single section must also hold one of its own
    fields (so that a ConfigMap's ``data:`` is not taken for the trainer's ``data:``)."""
    sections = {f.name: f for f in fields(config)}
    if not set(document) <= set(sections):
        return False
    if len(document) > 1:
        return True
    (key, value), = document.items()
    try:
        section = typing.get_type_hints(config)[key]
    except Exception:
        return True
    section = next((a for a in typing.get_args(section) if is_dataclass(a)), section)
    if not is_dataclass(section):
        return True
    return isinstance(value, dict) and bool(set(value) & {f.name for f in fields(section)})


def _is_label_map(parent: str | None) -> bool:
    """labels, matchLabels, commonLabels, nodeSelector, labelSelector, ... (not annotations)."""
    return bool(parent) and bool(re.search(r"(?i)labels$|selector$|^selector|matchExpressions", parent or ""))


def inline_command(text: str) -> bool:
    """Whether an inline code span reads as a command line: a program the command checker
    knows (this project's, torchrun, ``python``, ``make``, ``kubectl``, ``pip``) with at least
    one argument. A bare name (`regroup-run`) names the program, and output
    (`regroup status: etcd denied ...`) is not a command."""
    words = strip_prefixes(text.split())
    if len(words) < 2 or _reads_as_output(words):
        return False
    return doc_checker().commands.is_checked_program(words[0])


def _reads_as_output(words: list[str]) -> bool:
    """``regroup whatif: 16 nodes ...`` is output that starts with a program's name."""
    return any(w.endswith(":") for w in words[:2])


@cache
def doc_checker() -> DocChecker:
    return DocChecker()
