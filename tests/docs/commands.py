"""The project's command lines as the docs write them, checked against the real parsers.

Each program's ``argparse`` parser is the one its entry point builds: the entry function is
called with ``ArgumentParser.parse_args`` patched to hand back the parser instead of
parsing (so nothing runs), and cached per program and subcommand. Commands of other tools
are not checked, except the paths ``kubectl apply`` and ``cd`` take into this repository and
the extras ``pip install`` asks of this project.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import os
import pkgutil
import re
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tests.docs.markdown import REPO

Report = Callable[[str, str], None]
"""report(message, needle): a problem, located at the first line of the command holding needle."""


# --- the project, read from its own files ------------------------------------------------


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@cache
def project_scripts() -> dict[str, str]:
    """Console scripts: this project's (pyproject) and torchrun (torch's)."""
    scripts = dict(pyproject().get("project", {}).get("scripts", {}))
    for ep in importlib.metadata.entry_points(group="console_scripts"):
        if ep.name == "torchrun":
            scripts.setdefault(ep.name, ep.value)
    return scripts


@cache
def project_packages() -> frozenset[str]:
    """Top-level import names that belong to this repository."""
    names = {"regroup"}
    names.update(p.name for p in REPO.iterdir() if (p / "__init__.py").is_file())
    return frozenset(names)


@cache
def rdzv_backends() -> frozenset[str]:
    names = set(pyproject().get("project", {}).get("entry-points", {}).get("torchrun.handlers", {}))
    names.update(ep.name for ep in importlib.metadata.entry_points(group="torchrun.handlers"))
    try:
        from torch.distributed.elastic.rendezvous import registry

        names.update(registry.rendezvous_handler_registry._registry)  # type: ignore[attr-defined]
    except Exception:
        names.update({"c10d", "etcd", "etcd-v2", "static"})
    return frozenset(names)


@dataclass
class Makefile:
    targets: dict[str, list[str]] = field(default_factory=dict)  # target -> prerequisites
    recipes: dict[str, list[str]] = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)

    def expand(self, text: str, overrides: dict[str, str], depth: int = 0) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            if name in overrides:
                return overrides[name]
            if name in self.variables and depth < 10:
                return self.expand(self.variables[name], overrides, depth + 1)
            return match.group(0)

        return re.sub(r"\$\((\w+)\)|\$\{(\w+)\}", one, text)

    def recipe_lines(self, target: str, seen: frozenset[str] = frozenset()) -> list[str]:
        if target in seen:
            return []
        lines = list(self.recipes.get(target, []))
        for prerequisite in self.targets.get(target, []):
            lines += self.recipe_lines(prerequisite, seen | {target})
        return lines


@cache
def makefile() -> Makefile:
    made = Makefile()
    path = REPO / "Makefile"
    if not path.is_file():
        return made
    current: list[str] = []
    for raw in path.read_text().split("\n"):
        if raw.startswith("\t"):
            for target in current:
                made.recipes.setdefault(target, []).append(raw[1:])
            continue
        line = raw.split("#", 1)[0].rstrip()
        assignment = re.match(r"^([A-Za-z_][\w.]*)\s*(?::{1,3}=|\?=|\+=|=)\s*(.*)$", line)
        if assignment:
            made.variables[assignment.group(1)] = assignment.group(2).strip()
            current = []
            continue
        rule = re.match(r"^([^\s:=#][^:=]*?)\s*::?(?!=)(.*)$", line)
        if rule:
            current = [t for t in rule.group(1).split() if "%" not in t and not t.startswith(".")]
            for target in current:
                made.targets.setdefault(target, []).extend(rule.group(2).split())
        elif line.strip():
            current = []
    return made


# --- parsers, taken from the entry points ------------------------------------------------


class NoParser(Exception):
    """The parser of a program could not be built (the message says why)."""


class _Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def _parsers_captured(argv0: str, argv: Sequence[str]) -> Iterator[None]:
    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    names = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")
    saved = {n: getattr(argparse.ArgumentParser, n) for n in names}
    saved_argv = sys.argv
    for n in names:
        setattr(argparse.ArgumentParser, n, grab)
    sys.argv = [argv0, *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for n, f in saved.items():
            setattr(argparse.ArgumentParser, n, f)
        sys.argv = saved_argv


def _uses_argparse(func: Callable[..., Any]) -> bool:
    """Whether calling func may reach a parser (else it is not called: it could do real work)."""
    module = inspect.getmodule(func)
    try:
        source = inspect.getsource(module) if module else ""
    except (OSError, TypeError):
        return False
    return "parse_args" in source or "parse_known_args" in source or "import main" in source


def capture_parser(func: Callable[..., Any], argv: Sequence[str], argv0: str = "prog") -> argparse.ArgumentParser | None:
    """The first parser func asks to parse argv, found without running anything past it;
    None if it parses nothing with argparse. Raises NoParser if func fails first."""
    func = inspect.unwrap(func)  # e.g. torchrun's @record, which would install a fault handler
    if not _uses_argparse(func):
        return None
    try:
        takes_argv = any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in inspect.signature(func).parameters.values()
        )
    except (TypeError, ValueError):
        takes_argv = False
    try:
        with _parsers_captured(argv0, argv):
            func(list(argv)) if takes_argv else func()
    except _Captured as captured:
        return captured.parser
    except (Exception, SystemExit) as exc:
        raise NoParser(f"{_qualname(func)}({list(argv)}) failed before parsing: {exc!r}") from None
    return None


def _qualname(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', func)}"


def _resolve(value: str) -> Callable[..., Any]:
    module_name, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for part in attr.strip().split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def is_placeholder(token: str) -> bool:
    """A word the reader replaces: <name>, $JOB, NAME, ..."""
    return bool(re.search(r"<.*>|\u2039|\$|\.\.\.|^[A-Z][A-Z0-9_]*$|^\{.*\}$", token))


# --- shell text to commands ---------------------------------------------------------------


@dataclass
class Command:
    words: list[str]
    lines: list[tuple[int, str]]
    """The physical (file line, text) lines the command spans, to locate a word in."""

    def line_of(self, needle: str) -> int:
        for number, text in self.lines:
            if needle and needle in text:
                return number
        return self.lines[0][0]


_SEPARATORS = {"&&", "||", ";", "|", "&", "|&", ";;"}
_WRAPPERS = {"sudo", "env", "time", "nohup", "exec", "nice", "command"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SYNOPSIS_GROUP = re.compile(r"\[([^\[\]\s][^\[\]]*)\]")


_ANGLE_PLACEHOLDER = re.compile(r"<([A-Za-z][\w.:/-]*)>")


def unwrap_synopsis(text: str) -> str:
    """A usage line as words: ``[--json]`` -> ``--json``; ``[--a | --b]`` -> ``--a --b``;
    ``HOST[,HOST]`` -> ``HOST,HOST``; ``<name>`` kept as one word (not a redirection)."""
    previous = None
    while previous != text:
        previous = text
        text = _SYNOPSIS_GROUP.sub(
            lambda m: " " + m.group(1).replace(" | ", " ") + " " if m.group(1).startswith("-") else m.group(1), text
        )
    return _ANGLE_PLACEHOLDER.sub(lambda m: f"\u2039{m.group(1)}\u203a", text)


def split_commands(text: str) -> list[list[str]]:
    """Words of each simple command of a shell line (operators split, redirections dropped)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    commands: list[list[str]] = [[]]
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word and set(word) <= set("();<>|&"):
            if word in _SEPARATORS:
                commands.append([])
            elif "<" in word or ">" in word:
                skip = not word.endswith("&")
                if commands[-1] and commands[-1][-1].isdigit():  # 2> file
                    commands[-1].pop()
            continue
        commands[-1].append(word)
    return [c for c in commands if c]


def strip_prefixes(words: list[str]) -> list[str]:
    """Drop ``FOO=1`` assignments and wrappers such as ``sudo``/``env`` before the program."""
    i = 0
    while i < len(words):
        if _ASSIGNMENT.match(words[i]):
            i += 1
        elif words[i] in _WRAPPERS:
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1
        else:
            break
    return words[i:]


# --- the checks ---------------------------------------------------------------------------


class CommandChecker:
    """Checks a command line against this project's parsers; problems go to ``report``."""

    def __init__(self) -> None:
        self._parsers: dict[tuple[str, ...], argparse.ArgumentParser | None | NoParser] = {}

    # Parsers, cached per (program, subcommand path); NoParser says why one cannot be built.

    def _parser(self, key: tuple[str, ...], make: Callable[[], argparse.ArgumentParser | None]) -> argparse.ArgumentParser | None:
        if key not in self._parsers:
            try:
                self._parsers[key] = make()
            except NoParser as exc:
                self._parsers[key] = exc
        found = self._parsers[key]
        if isinstance(found, NoParser):
            raise found
        return found

    def program_parser(self, program: str, prefix: tuple[str, ...] = ()) -> argparse.ArgumentParser | None:
        def make() -> argparse.ArgumentParser | None:
            try:
                entry = _resolve(project_scripts()[program])
            except Exception as exc:
                raise NoParser(f"entry point {project_scripts()[program]}: {exc!r}") from None
            return capture_parser(entry, list(prefix), argv0=program)

        return self._parser(("script", program, *prefix), make)

    def module_parser(self, module: str, prefix: tuple[str, ...] = ()) -> argparse.ArgumentParser | None:
        def make() -> argparse.ArgumentParser | None:
            try:
                runnable = importlib.import_module(module)
            except Exception as exc:
                raise NoParser(f"import {module}: {exc!r}") from None
            if not prefix and callable(getattr(runnable, "build_parser", None)):
                try:
                    parser = runnable.build_parser()
                except Exception:  # noqa: BLE001 - a build_parser that needs arguments: use main's below
                    parser = None
                if isinstance(parser, argparse.ArgumentParser):
                    return parser
            main = getattr(runnable, "main", None)
            return capture_parser(main, list(prefix), argv0=module) if callable(main) else None

        return self._parser(("module", module, *prefix), make)

    # Dispatch.

    def check(self, words: list[str], report: Report) -> None:
        words = strip_prefixes(words)
        if not words:
            return
        program = os.path.basename(words[0])
        args = words[1:]
        if re.fullmatch(r"python(3(\.\d+)?)?", program):
            self.check_python(args, report)
        elif program == "make":
            self.check_make(args, report)
        elif program in project_scripts():
            self.check_program(program, args, report)
        elif program == "kubectl":
            self.check_kubectl(args, report)
        elif program in ("pip", "pip3"):
            self.check_pip(args, report)
        elif program == "cd" and args:
            self.check_repo_path(args[0], report, "cd")

    def is_checked_program(self, word: str) -> bool:
        program = os.path.basename(word)
        return bool(re.fullmatch(r"python(3(\.\d+)?)?", program)) or program in project_scripts() or program in (
            "make",
            "kubectl",
            "pip",
            "pip3",
        )

    def check_program(self, program: str, args: list[str], report: Report) -> None:
        try:
            parser = self.program_parser(program)
        except NoParser as exc:
            report(f"{program}: cannot build its parser to check this command: {exc}", program)
            return
        if parser is None:
            report(f"{program}: its entry point builds no argparse parser to check this command against", program)
            return
        self.walk(parser, args, report, lazy=lambda prefix: self.program_parser(program, prefix))

    def check_python(self, args: list[str], report: Report) -> None:
        i = 0
        while i < len(args):
            word = args[i]
            if word == "-m" and i + 1 < len(args):
                self.check_module_run(args[i + 1], args[i + 2 :], report)
                return
            if word.startswith("-m") and len(word) > 2:
                self.check_module_run(word[2:], args[i + 1 :], report)
                return
            if word == "-c" and i + 1 < len(args):
                try:
                    ast.parse(args[i + 1])
                except SyntaxError as exc:
                    report(f"python -c: not valid Python: {exc.msg}", "-c")
                return
            if word in ("-X", "-W", "-Q"):
                i += 2
                continue
            if word.startswith("-"):
                i += 1
                continue
            self.check_script(word, args[i + 1 :], report)
            return

    def check_module_run(self, module: str, args: list[str], report: Report) -> None:
        """``python -m module args`` (also torchrun's ``-m``)."""
        if is_placeholder(module):
            return
        top = module.split(".")[0]
        if top == "pytest":
            for arg in args:
                if not arg.startswith("-") and "/" in arg:
                    self.check_repo_path(arg.split("::")[0], report, "pytest")
            return
        if top == "pip":
            self.check_pip(args, report)
            return
        if top not in project_packages():
            return
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            report(f"python -m {module}: no module named {module!r}", module)
            return
        runnable = module
        if spec.submodule_search_locations is not None:
            runnable = f"{module}.__main__"
            if importlib.util.find_spec(runnable) is None:
                report(f"python -m {module}: {module} is a package without __main__", module)
                return
        if module == "bench":
            self.check_bench(args, report)
            return
        try:
            parser = self.module_parser(runnable)
        except NoParser as exc:
            report(f"python -m {module}: {exc}", module)
            return
        if parser is not None:
            self.walk(parser, args, report, lazy=lambda prefix: self.module_parser(runnable, prefix))

    def check_bench(self, args: list[str], report: Report) -> None:
        """``python -m bench NAME [ARGS]``: NAME is a module of bench/ (not _private), run as main(ARGS);
        ``python -m bench --help`` lists them."""
        if not args:
            report("python -m bench: a benchmark name is required", "bench")
            return
        name = args[0]
        if name in ("-h", "--help"):
            return  # bench/__main__.py lists the benchmarks
        import bench

        names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))
        if is_placeholder(name):
            # Any benchmark: each option must be one that some benchmark takes.
            known: set[str] = set()
            for other in names:
                try:
                    parser = self.module_parser(f"bench.{other}")
                except NoParser as exc:
                    report(f"python -m bench {other}: {exc}", name)
                    return
                known.update(parser._option_string_actions if parser else ())
            for word in args[1:]:
                if word.startswith("-") and word != "--" and word.split("=", 1)[0] not in known:
                    report(f"python -m bench <name>: no benchmark takes {word.split('=', 1)[0]}", word)
            return
        if name not in names:
            report(f"python -m bench: no benchmark {name!r} (known: {', '.join(names)})", name)
            return
        try:
            parser = self.module_parser(f"bench.{name}")
        except NoParser as exc:
            report(f"python -m bench {name}: {exc}", name)
            return
        if parser is None:
            report(f"python -m bench {name}: its main builds no argparse parser to check this command against", name)
            return
        self.walk(parser, args[1:], report, lazy=lambda prefix: self.module_parser(f"bench.{name}", prefix))

    def check_script(self, path: str, args: list[str], report: Report) -> None:
        """A script run by path: in this repository, it must exist, and take the options given."""
        if is_placeholder(path) or not self.check_repo_path(path, report, "script"):
            return
        file = REPO / path
        if file.suffix != ".py" or not file.is_file():
            return
        options: set[str] = set()
        flags: set[str] = set()  # options that take no value
        remainder = False  # a positional that takes the rest: e.g. tests/busy.py's command
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                names = {
                    a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
                }
                options.update(names)
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if keywords.get("action", "").strip("'\"") in _FLAG_ACTIONS or keywords.get("nargs") == "0":
                    flags.update(names)
                if not names and keywords.get("nargs") in ("argparse.REMAINDER", "REMAINDER", "'...'"):
                    remainder = True
        if not options:
            return
        options.update({"-h", "--help"})
        flags.update({"-h", "--help"})
        index = 0
        while index < len(args):
            arg = args[index]
            if arg in ("--", "..."):
                return
            if remainder and not arg.startswith("-"):
                if self.is_checked_program(arg):
                    self.check(args[index:], report)
                return
            if remainder and arg in options and arg not in flags and "=" not in arg:
                index += 1  # its value
            index += 1
            if arg.startswith("-") and not _is_number(arg):
                name = arg.split("=", 1)[0]
                if name not in options:
                    report(f"{path}: no option {name}{_did_you_mean(name, options)}", arg)

    def check_repo_path(self, path: str, report: Report, what: str) -> bool:
        """A relative path whose first part is a folder of this repository must exist; True if it is one."""
        if is_placeholder(path) or path.startswith(("/", "~", "-")) or "://" in path:
            return False
        first = Path(path).parts[0] if Path(path).parts else ""
        if not first or first in (".", "..") or not (REPO / first).is_dir():
            return False
        if not (REPO / path).exists():
            report(f"{what}: no such path in the repository: {path}", path)
            return False
        return True

    def check_make(self, args: list[str], report: Report) -> None:
        made = makefile()
        overrides: dict[str, str] = {}
        targets: list[str] = []
        i = 0
        while i < len(args):
            word = args[i]
            if word in ("-C", "-f", "-j", "-l", "-o", "-W", "-I") and i + 1 < len(args):
                i += 2
                continue
            if word.startswith("-"):
                i += 1
                continue
            if _ASSIGNMENT.match(word):
                name, _, value = word.partition("=")
                overrides[name] = value
            else:
                targets.append(word)
            i += 1
        for target in targets:
            if target not in made.targets:
                report(f"make: no target {target!r} in the Makefile (targets: {', '.join(sorted(made.targets))})", target)
                continue
            recipe = made.recipe_lines(target)
            for name, value in overrides.items():
                using = [line for line in recipe if f"$({name})" in line or f"${{{name}}}" in line]
                if not using:
                    report(f"make {target}: the recipe does not use {name}", f"{name}=")
                    continue
                quoted = {k: " ".join(shlex.quote(w) for w in v.split()) for k, v in overrides.items()}
                for line in using:
                    expanded = made.expand(line, quoted).lstrip("@-+ ").replace("$$", "$")
                    try:
                        commands = split_commands(expanded)
                    except ValueError:
                        continue
                    for command in commands:
                        self.check(command, report)

    def check_kubectl(self, args: list[str], report: Report) -> None:
        if "--" in args and "exec" in args[: args.index("--")]:
            self.check(args[args.index("--") + 1 :], report)
            return
        if not args or not any(a in ("apply", "create", "delete", "diff", "replace") for a in args):
            return
        for i, word in enumerate(args):
            value = None
            if word in ("-k", "-f", "--kustomize", "--filename") and i + 1 < len(args):
                value = args[i + 1]
            elif word.startswith(("--kustomize=", "--filename=")):
                value = word.split("=", 1)[1]
            if value and value != "-" and "://" not in value and not value.startswith(("/", "~")) and not is_placeholder(value):
                if not (REPO / value).exists():
                    report(f"kubectl {word}: no such path in the repository: {value}", value)

    def check_pip(self, args: list[str], report: Report) -> None:
        if "install" not in args:
            return
        extras_known = set(pyproject().get("project", {}).get("optional-dependencies", {}))
        name = pyproject().get("project", {}).get("name", "regroup")
        for word in args:
            match = re.fullmatch(rf"(?:{re.escape(name)}|\.|\./)\[([^\]]*)\]", word)
            if match:
                for extra in (e.strip() for e in match.group(1).split(",")):
                    if extra and extra not in extras_known:
                        report(f"pip install: {name} has no extra {extra!r} (extras: {', '.join(sorted(extras_known))})", extra)

    # One parser over its arguments.

    def walk(
        self,
        parser: argparse.ArgumentParser,
        args: list[str],
        report: Report,
        lazy: Callable[[tuple[str, ...]], argparse.ArgumentParser | None] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """Check args against parser: options exist, choices hold, subcommands exist; a
        launcher's script (torchrun/regroup-run) is checked as a command of its own."""
        prog = parser.prog
        by_option = parser._option_string_actions
        positionals = [a for a in parser._actions if not a.option_strings]
        seen: dict[str, Any] = {}
        pos_index = 0
        i = 0
        while i < len(args):
            word = args[i]
            if word == "...":
                break
            if word == "--":
                break
            if word.startswith("-") and word != "-" and not _is_number(word):
                action, value = _find_option(by_option, word)
                if action is None:
                    name = word.split("=", 1)[0]
                    report(f"{prog}: no option {name}{_did_you_mean(name, by_option)}", word)
                    i += 1
                    if "=" not in word and i < len(args) and not args[i].startswith("-"):
                        i += 1  # its value, most likely
                    continue
                if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                    return
                values: list[str] = []
                if value is not None:
                    values = [value]
                elif action.nargs is None or isinstance(action.nargs, int) and action.nargs >= 1:
                    count = 1 if action.nargs is None else int(action.nargs)
                    values = args[i + 1 : i + 1 + count]
                    i += len(values)
                elif action.nargs in ("?", "*", "+"):
                    while i + 1 < len(args) and not args[i + 1].startswith("-") and args[i + 1] != "...":
                        values.append(args[i + 1])
                        i += 1
                        if action.nargs == "?":
                            break
                seen[action.dest] = values[-1] if values else True
                for v in values:
                    if action.choices is not None and not is_placeholder(v) and v not in action.choices:
                        report(f"{prog} {word.split('=', 1)[0]}: {v!r} is not one of {', '.join(map(str, action.choices))}", v)
                i += 1
                continue
            # A positional word.
            action = positionals[pos_index] if pos_index < len(positionals) else None
            if isinstance(action, argparse._SubParsersAction):
                self._after_options(seen, report)
                if is_placeholder(word):
                    return
                if word not in action.choices:
                    report(f"{prog}: no subcommand {word!r} (known: {', '.join(action.choices)})", word)
                    return
                try:
                    sub = lazy(prefix + (word,)) if lazy else None
                except NoParser as exc:
                    report(f"{prog} {word}: cannot build its parser to check this command: {exc}", word)
                    return
                if sub is None or sub.prog == prog:
                    sub = action.choices[word]
                self.walk(sub, args[i + 1 :], report, lazy, prefix + (word,))
                return
            if action is None:
                if not is_placeholder(word):
                    report(f"{prog}: takes no further argument {word!r}", word)
                i += 1
                continue
            nxt = positionals[pos_index + 1] if pos_index + 1 < len(positionals) else None
            if action.nargs == argparse.REMAINDER or (nxt is not None and nxt.nargs == argparse.REMAINDER):
                self._after_options(seen, report)
                script_args = args[i + 1 :]
                if seen.get("module") is True:
                    self.check_module_run(word, script_args, report)
                elif seen.get("no_python") is True:
                    self.check([word, *script_args], report)
                else:
                    self.check_script(word, script_args, report)
                return
            if action.choices is not None and not is_placeholder(word) and word not in action.choices:
                report(f"{prog}: {word!r} is not one of {', '.join(map(str, action.choices))}", word)
            if action.nargs not in ("*", "+"):
                pos_index += 1
            i += 1
        self._after_options(seen, report)

    def _after_options(self, seen: dict[str, Any], report: Report) -> None:
        backend = seen.get("rdzv_backend")
        if isinstance(backend, str) and not is_placeholder(backend) and backend not in rdzv_backends():
            report(f"--rdzv-backend: no rendezvous backend {backend!r} (known: {', '.join(sorted(rdzv_backends()))})", backend)
        conf = seen.get("rdzv_conf")
        if backend == "etcd-v3" and isinstance(conf, str):
            self.check_rdzv_conf(conf, report)

    def check_rdzv_conf(self, conf: str, report: Report) -> None:
        """``--rdzv-conf k=v,...`` as the etcd-v3 backend reads it (unknown keys are refused)."""
        from regroup.rendezvous.settings import SettingsError, normalize_conf

        pairs: dict[str, str] = {}
        for item in filter(None, conf.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                report(f"--rdzv-conf: {item!r} is not key=value", item)
                continue
            pairs[key.strip()] = value.strip()
        for key, value in pairs.items():
            probe = {key: "1" if is_placeholder(value) else value}
            try:
                normalize_conf(probe)
            except SettingsError as exc:
                if is_placeholder(value) and "unknown" not in str(exc):
                    continue
                report(f"--rdzv-conf {key}: {exc}", f"{key}=")


_FLAG_ACTIONS = {"store_true", "store_false", "store_const", "append_const", "count", "help", "version"}


def _is_number(word: str) -> bool:
    return bool(re.fullmatch(r"-\d+(\.\d+)?", word))


def _find_option(by_option: dict[str, argparse.Action], word: str) -> tuple[argparse.Action | None, str | None]:
    if word in by_option:
        return by_option[word], None
    if "=" in word:
        name, _, value = word.partition("=")
        if name in by_option:
            return by_option[name], value
    if not word.startswith("--") and len(word) > 2 and word[:2] in by_option:  # -n4
        action = by_option[word[:2]]
        if action.nargs != 0:
            return action, word[2:]
    return None, None


def _did_you_mean(name: str, options: Any) -> str:
    known = sorted(o for o in options if o.startswith("--") == name.startswith("--"))
    prefixed = [o for o in known if o.startswith(name)]
    if len(prefixed) == 1:
        return f" (argparse would take it as an abbreviation of {prefixed[0]}: spell it out)"
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""
