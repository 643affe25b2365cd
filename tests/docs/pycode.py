"""Python in the docs, checked against the code it uses.

A block must parse. Its imports of this project must resolve; attributes used on a module
of this project must exist; calls of this project's functions and classes must bind to
their signatures (keywords that disappear into ``**kwargs`` are followed to where they are
forwarded); and attributes used on an object whose type is plain from the code (``for step
in elastic.Run(...)``, ``world = elastic.world()``) must exist on that type. Anything
whose type is not known (the user's model, a fixture) is not checked.

``elastic`` is the public API module, ``regroup.elastic``, in any block that uses it
without importing it.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

from tests.docs.commands import project_packages
from tests.docs.markdown import REPO

API_MODULES = ("regroup.elastic",)

LineReport = Callable[[int, str], None]


@cache
def api_module() -> ModuleType:
    """The public API module."""
    errors = []
    for name in API_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {exc!r}")
            continue
        if hasattr(module, "Run"):
            return module
        errors.append(f"{name}: has no Run")
    raise ImportError("no public API module: " + "; ".join(errors))


@cache
def config_loading_module() -> ModuleType:
    """The module that defines ``config_from_dict`` (the trainer's config loader), wherever it lives."""
    for name in ("regroup.trainer.config_loading",):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "config_from_dict"):
            return module
    for root, _, files in os.walk(REPO / "regroup", followlinks=True):
        for file in files:
            path = os.path.join(root, file)
            if file.endswith(".py") and "def config_from_dict(" in open(path, encoding="utf-8").read():
                relative = os.path.relpath(path, REPO)[: -len(".py")]
                return importlib.import_module(relative.replace(os.sep, "."))
    raise ImportError("no module defines config_from_dict")


def ours(obj: Any) -> bool:
    name = obj.__name__ if isinstance(obj, ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and name.split(".")[0] in project_packages()


@dataclass(frozen=True)
class Known:
    """What an expression is known to be: a module, a function or class, an instance, a bound method."""

    kind: str  # "module" | "object" | "instance" | "method"
    value: Any


def _known(obj: Any) -> Known | None:
    if isinstance(obj, ModuleType):
        return Known("module", obj) if ours(obj) else None
    if (inspect.isclass(obj) or callable(obj)) and ours(obj):
        return Known("object", obj)
    return None


def _instance(tp: Any) -> Known | None:
    """An instance of tp, if tp is one of our classes (Optional[tp] included)."""
    if tp is None:
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    return Known("instance", tp) if inspect.isclass(tp) and ours(tp) else None


@cache
def _returns(func: Any) -> Any:
    func = inspect.unwrap(func)
    try:
        return typing.get_type_hints(func).get("return")
    except Exception:
        raw = getattr(func, "__annotations__", {}).get("return")
        if isinstance(raw, str):
            try:
                return eval(raw, getattr(func, "__globals__", {}))  # noqa: S307 - the project's own annotation
            except Exception:
                return None
        return raw


@cache
def instance_members(cls: type) -> frozenset[str] | None:
    """Attributes an instance of cls has: class members, annotations, and ``self.x =`` in its code.
    None if a class of it defines ``__getattr__`` (anything goes)."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass is object:
            continue
        if "__getattr__" in vars(klass):
            return None
        names.update(getattr(klass, "__annotations__", {}))
        slots = vars(klass).get("__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                return None  # attributes set by name: not knowable
    return frozenset(names)


def _function_node(func: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func.__name__:
            return node
    return None


def _resolve_name(node: ast.expr, namespace: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve_name(node.value, namespace)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def forwarded(func: Any, names: list[str], depth: int = 0) -> tuple[list[str], list[str]]:
    """Of keyword names that land in func's ``**kwargs``: (refused, swallowed). A name is
    followed to the calls that pass ``**kwargs`` on; refused where no callee takes it,
    swallowed where it reaches a ``**kwargs`` that is used otherwise."""
    target = inspect.unwrap(func.__init__ if inspect.isclass(func) else func)
    node = _function_node(target)
    if node is None or node.args.kwarg is None or depth > 4:
        return [], list(names)
    kwarg = node.args.kwarg.arg
    calls = [
        c
        for c in ast.walk(node)
        if isinstance(c, ast.Call)
        and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg for k in c.keywords)
    ]
    if not calls:
        return [], list(names)
    namespace = {**vars(builtins), **getattr(target, "__globals__", {})}
    accepted: set[str] = set()
    swallowed: set[str] = set()
    for call in calls:
        callee = _resolve_name(call.func, namespace)
        if callee is None:
            return [], list(names)
        try:
            sig = inspect.signature(callee)
        except (TypeError, ValueError):
            return [], list(names)
        named = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        rest = [n for n in names if n not in named]
        accepted.update(n for n in names if n in named)
        if rest and any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            refused_here, swallowed_here = forwarded(callee, rest, depth + 1)
            accepted.update(set(rest) - set(refused_here) - set(swallowed_here))
            swallowed.update(swallowed_here)
    refused = [n for n in names if n not in accepted and n not in swallowed]
    return refused, [n for n in names if n in swallowed and n not in accepted]


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", "")
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


class PythonChecker:
    """Checks Python source (a block, or statements pulled out of a diff)."""

    def __init__(self) -> None:
        self._api: ModuleType | None = None

    @property
    def api(self) -> ModuleType:
        if self._api is None:
            self._api = api_module()
        return self._api

    def check_block(self, lines: Iterable[str], first_line: int, report: LineReport) -> None:
        source = "\n".join(lines)
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            report(first_line + (exc.lineno or 1) - 1, f"not valid Python: {exc.msg}")
            return
        _Scope(self, report, lambda n: first_line + getattr(n, "lineno", 1) - 1).run(tree.body)

    def check_diff(self, lines: list[str], first_line: int, report: LineReport) -> None:
        """The new side of a diff, a line at a time: what parses alone is checked as code,
        the rest for ``elastic.<...>`` expressions."""
        statements: list[tuple[ast.stmt, int]] = []
        for offset, raw in enumerate(lines):
            if raw.startswith(("+++", "---", "@@", "-")) or raw.startswith("\\"):
                continue
            text = raw[1:] if raw[:1] in ("+", " ") else raw
            text = text.strip()
            if not text or text.startswith("#"):
                continue
            line = first_line + offset
            parsed = None
            for suffix in ("", "\n    pass", "\ndef _(): pass"):
                try:
                    parsed = ast.parse(text + suffix).body
                    break
                except SyntaxError:
                    continue
            if parsed is None:
                parsed = []
                for match in re.finditer(r"(?<![\w.])elastic\.\w+", text):
                    expression = _balanced(text, match.start())
                    try:
                        parsed.append(ast.Expr(ast.parse(expression, mode="eval").body))
                    except SyntaxError:
                        continue
            statements += [(s, line) for s in parsed]
        scope = _Scope(self, report, lambda n: 0)
        for statement, line in statements:
            scope.line_of = lambda n, line=line: line  # type: ignore[misc]
            scope.stmt(statement)


def _balanced(text: str, start: int) -> str:
    """The longest ``a.b(...)[...].c`` expression that starts at text[start]."""
    i, depth = start, 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0 and not (ch.isalnum() or ch in "_."):
            break
        i += 1
    return text[start:i]


class _Scope:
    """One pass over statements in order, knowing what names are bound to (flow-insensitive)."""

    def __init__(self, checker: PythonChecker, report: LineReport, line_of: Callable[[ast.AST], int]) -> None:
        self.checker = checker
        self.report = report
        self.line_of = line_of
        self.env: dict[str, Known] = {"elastic": Known("module", checker.api)}

    def problem(self, node: ast.AST, message: str) -> None:
        self.report(self.line_of(node), message)

    def run(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            self.stmt(statement)

    # Statements.

    def stmt(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.import_(node, alias.name, alias.asname)
        elif isinstance(node, ast.ImportFrom):
            self.import_from(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                self.expr(decorator)
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    self.expr(base)
            else:
                for default in [*node.args.defaults, *node.args.kw_defaults]:
                    if default is not None:
                        self.expr(default)
                for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
                    if arg is not None:
                        self.env.pop(arg.arg, None)
            self.env.pop(node.name, None)
            self.run(node.body)
            self.env.pop(node.name, None)
        elif isinstance(node, ast.Assign):
            known = self.expr(node.value)
            for target in node.targets:
                self.bind(target, known)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            known = self.expr(node.value) if node.value is not None else None
            self.bind(node.target, known if isinstance(node, ast.AnnAssign) else None)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.bind(node.target, self.element(self.expr(node.iter), isinstance(node, ast.AsyncFor)))
            self.run(node.body)
            self.run(node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                known = self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, self.entered(known, isinstance(node, ast.AsyncWith)))
            self.run(node.body)
        else:
            self.generic(node)

    def generic(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.stmt(child)
            elif isinstance(child, ast.expr):
                self.expr(child)
            else:
                self.generic(child)

    def bind(self, target: ast.expr, known: Known | None) -> None:
        if isinstance(target, ast.Name):
            if known is None:
                self.env.pop(target.id, None)
            else:
                self.env[target.id] = known
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.bind(element.value if isinstance(element, ast.Starred) else element, None)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            self.expr(target.value)

    # Imports.

    def import_(self, node: ast.stmt, name: str, asname: str | None) -> None:
        top = name.split(".")[0]
        bound = asname or top
        if top not in project_packages():
            self.env.pop(bound, None)
            return
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            self.problem(node, f"import {name}: {type(exc).__name__}: {exc}")
            self.env.pop(bound, None)
            return
        self.env[bound] = Known("module", module if asname else importlib.import_module(top))

    def import_from(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] not in project_packages():
            for alias in node.names:
                self.env.pop(alias.asname or alias.name, None)
            return
        try:
            module = importlib.import_module(node.module)
        except Exception as exc:
            self.problem(node, f"from {node.module} import ...: {type(exc).__name__}: {exc}")
            for alias in node.names:
                self.env.pop(alias.asname or alias.name, None)
            return
        for alias in node.names:
            if alias.name == "*":
                continue
            bound = alias.asname or alias.name
            if hasattr(module, alias.name):
                obj = getattr(module, alias.name)
            else:
                try:
                    obj = importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    self.problem(node, f"from {node.module} import {alias.name}: {node.module} has no {alias.name!r}")
                    self.env.pop(bound, None)
                    continue
            known = _known(obj)
            if known is None:
                self.env.pop(bound, None)
            else:
                self.env[bound] = known

    # Expressions.

    def expr(self, node: ast.expr) -> Known | None:
        if isinstance(node, ast.Name):
            return self.env.get(node.id) if isinstance(node.ctx, ast.Load) else None
        if isinstance(node, ast.Attribute):
            return self.attribute(self.expr(node.value), node)
        if isinstance(node, ast.Call):
            function = self.expr(node.func)
            for arg in node.args:
                self.expr(arg.value if isinstance(arg, ast.Starred) else arg)
            for keyword in node.keywords:
                self.expr(keyword.value)
            return self.call(function, node)
        if isinstance(node, ast.NamedExpr):
            known = self.expr(node.value)
            self.bind(node.target, known)
            return known
        self.generic(node)
        return None

    def attribute(self, base: Known | None, node: ast.Attribute) -> Known | None:
        if base is None:
            return None
        name = node.attr
        if base.kind == "module":
            module = base.value
            if hasattr(module, name):
                return _known(getattr(module, name))
            submodule = f"{module.__name__}.{name}"
            try:
                if importlib.util.find_spec(submodule) is not None:
                    return _known(importlib.import_module(submodule))
            except Exception as exc:  # noqa: BLE001 - a submodule that fails to import is reported
                self.problem(node, f"{submodule}: {exc!r}")
                return None
            self.problem(node, f"{module.__name__} has no attribute {name!r}")
            return None
        if base.kind == "object":
            obj = base.value
            if inspect.isclass(obj):
                if not hasattr(obj, name):
                    self.problem(node, f"{_qualname(obj)} has no attribute {name!r}")
                    return None
                return _known(getattr(obj, name))
            return None
        if base.kind == "instance":
            cls = base.value
            members = instance_members(cls)
            if members is None:
                return None
            if name not in members:
                self.problem(node, f"a {cls.__name__} ({_qualname(cls)}) has no attribute {name!r}")
                return None
            static = None
            for klass in cls.__mro__:
                if name in vars(klass):
                    static = vars(klass)[name]
                    break
            if isinstance(static, property):
                return _instance(_returns(static.fget)) if static.fget else None
            if isinstance(static, (staticmethod, classmethod)):
                return _known(getattr(cls, name))
            if inspect.isfunction(static):
                return Known("method", static)
            for klass in cls.__mro__:
                annotation = getattr(klass, "__annotations__", {}).get(name)
                if annotation is not None:
                    try:
                        hints = typing.get_type_hints(klass)
                    except Exception:
                        return None
                    return _instance(hints.get(name))
            return None
        return None

    def call(self, function: Known | None, node: ast.Call) -> Known | None:
        if function is None:
            return None
        if function.kind == "object":
            obj = function.value
            self.check_call(obj, node, bound=False)
            return _instance(obj) if inspect.isclass(obj) else _instance(_returns(obj))
        if function.kind == "method":
            self.check_call(function.value, node, bound=True)
            return _instance(_returns(function.value))
        return None

    def element(self, known: Known | None, is_async: bool) -> Known | None:
        if known is None or known.kind != "instance":
            return None
        method = getattr(known.value, "__aiter__" if is_async else "__iter__", None)
        if method is None:
            return None
        returned = _returns(method)
        args = typing.get_args(returned)
        return _instance(args[0]) if args else None

    def entered(self, known: Known | None, is_async: bool) -> Known | None:
        if known is None or known.kind != "instance":
            return None
        method = getattr(known.value, "__aenter__" if is_async else "__enter__", None)
        if method is None:
            return None
        returned = _returns(method)
        if returned is typing.Self or getattr(returned, "__name__", None) == "Self":
            return known
        return _instance(returned)

    def check_call(self, obj: Any, node: ast.Call, bound: bool) -> None:
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):
            return
        parameters = list(signature.parameters.values())
        if bound and parameters:
            parameters = parameters[1:]
            signature = signature.replace(parameters=parameters)
        name = _qualname(obj)
        keywords = [k for k in node.keywords if k.arg is not None]
        spread = any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args)
        positional = [a for a in node.args if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]
        named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
        if not spread:
            try:
                signature.bind_partial(*[None] * len(positional), **{k.arg: None for k in keywords})
            except TypeError as exc:
                self.problem(node, f"{name}(...): {exc}")
                return
        elif not takes_any:
            for keyword in keywords:
                if keyword.arg not in named:
                    self.problem(keyword, f"{name}(...) takes no keyword argument {keyword.arg!r}")
        if not takes_any:
            return
        extra = [k.arg for k in keywords if k.arg not in named]
        if not extra:
            return
        refused, swallowed = forwarded(obj, extra)
        if obj is getattr(self.checker.api, "Run", None):
            # Run's docstring: any other keyword is a section of the run's settings tree by name.
            sections = _run_sections()
            refused += [n for n in swallowed if n not in sections]
        for keyword in keywords:
            if keyword.arg in refused:
                self.problem(keyword, f"{name}(...) takes no keyword argument {keyword.arg!r}{_close(keyword.arg, named)}")


@cache
def _run_sections() -> frozenset[str]:
    from regroup.elastic.options import Sections

    return frozenset(f.name for f in dataclasses.fields(Sections))


def _close(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=2)
    return f" (did you mean {' or '.join(close)}?)" if close else ""
