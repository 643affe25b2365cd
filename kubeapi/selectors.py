"""Label and field selectors with the syntax and matching rules of k8s.io/apimachinery."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubeapi.errors import ApiError, bad_request

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class Requirement:
    """One label requirement: key, operator (=, !=, in, notin, exists, !), values."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        # "!=" and "notin" also match objects that lack the label, as in apimachinery.
        return not present or labels[self.key] not in self.values


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        return all(r.matches(labels or {}) for r in self.requirements)


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parses `a=b,c!=d,e in (f,g),h notin (i),j,!k`; 400 BadRequest naming the bad term."""
    if not text or not text.strip():
        return LabelSelector(())
    return LabelSelector(tuple(_parse_requirement(term) for term in _split_terms(text)))


def _split_terms(text: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t.strip() for t in terms]


_EXPRESSION_OPS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}


def selector_from_object(selector: Any) -> LabelSelector | None:
    """A metav1.LabelSelector object (`matchLabels`, `matchExpressions`) as LabelSelector, as
    LabelSelectorAsSelector reads it: None for a null selector, which matches nothing; `{}`
    matches everything. Raises ValueError naming the field that is wrong."""
    if selector is None:
        return None
    if not isinstance(selector, Mapping):
        raise ValueError(f"selector: must be an object, got {selector!r}")
    requirements: list[Requirement] = []
    match_labels = selector.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise ValueError("selector.matchLabels: must be a map of strings")
    for key, value in match_labels.items():
        if not isinstance(value, str) or not _is_key(key) or not _is_value(value):
            raise ValueError(f"selector.matchLabels: invalid label {key!r}: {value!r}")
        requirements.append(Requirement(key, "=", frozenset({value})))
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise ValueError("selector.matchExpressions: must be a list")
    for i, expression in enumerate(expressions):
        where = f"selector.matchExpressions[{i}]"
        if not isinstance(expression, Mapping):
            raise ValueError(f"{where}: must be an object")
        key, op, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        if not isinstance(key, str) or not _is_key(key):
            raise ValueError(f"{where}.key: invalid label key {key!r}")
        if op not in _EXPRESSION_OPS:
            raise ValueError(f"{where}.operator: {op!r} is not a valid selector operator")
        if not isinstance(values, list) or not all(isinstance(v, str) and _is_value(v) for v in values):
            raise ValueError(f"{where}.values: must be a list of label values")
        if op in ("In", "NotIn") and not values:
            raise ValueError(f"{where}.values: must be specified when `operator` is 'In' or 'NotIn'")
        if op in ("Exists", "DoesNotExist") and values:
            raise ValueError(f"{where}.values: may not be specified when `operator` is 'Exists' or 'DoesNotExist'")
        requirements.append(Requirement(key, _EXPRESSION_OPS[op], frozenset(values)))
    return LabelSelector(tuple(requirements))


def _is_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_LABEL_KEY.match(key)) and len(key.rsplit("/", 1)[-1]) <= 63


def _is_value(value: str) -> bool:
    return bool(_LABEL_VALUE.match(value)) and len(value) <= 63


_SET_TERM = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_EQ_TERM = re.compile(r"^(?P<key>[^=!\s]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^=!\s]*)$")


def _parse_requirement(term: str) -> Requirement:
    if not term:
        raise bad_request("unable to parse requirement: found '', expected: identifier")
    if m := _SET_TERM.match(term):
        values = [v.strip() for v in m["values"].split(",")]
        return Requirement(_key(m["key"]), m["op"], frozenset(_value(v) for v in values))
    if m := _EQ_TERM.match(term):
        op = "!=" if m["op"] == "!=" else "="
        return Requirement(_key(m["key"]), op, frozenset({_value(m["value"])}))
    if term.startswith("!"):
        return Requirement(_key(term[1:].strip()), "!")
    if " " not in term:
        return Requirement(_key(term), "exists")
    raise bad_request(f"unable to parse requirement: {term!r}")


def _key(key: str) -> str:
    if not _is_key(key):
        raise bad_request(f"unable to parse requirement: invalid label key {key!r}")
    return key


def _value(value: str) -> str:
    if not _is_value(value):
        raise bad_request(f"unable to parse requirement: invalid label value: {value!r}")
    return value


@dataclass(frozen=True)
class FieldSelector:
    """Conjunction of (field, equal?, value) terms over an object's selectable fields."""

    terms: tuple[tuple[str, bool, str], ...]
    defaults: Mapping[str, str] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return all((self.value(obj, path) == value) == equal for path, equal, value in self.terms)

    def value(self, obj: Mapping[str, Any], label: str) -> str:
        found = field_value(obj, self.aliases.get(label, label))
        return found if found else self.defaults.get(label, "")


def parse_field_selector(
    text: str | None,
    supported: Iterable[str],
    defaults: Mapping[str, str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> FieldSelector:
    """Parses `a=b,c!=d`; a field the resource does not index gives 400 as on the real server."""
    if not text or not text.strip():
        return FieldSelector((), dict(defaults or {}), dict(aliases or {}))
    allowed = set(supported)
    terms = []
    for term in text.split(","):
        m = re.match(r"^\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        path, op, value = m.groups()
        if path not in allowed:
            raise ApiError(400, f"field label not supported: {path}")
        terms.append((path, op != "!=", value))
    return FieldSelector(tuple(terms), dict(defaults or {}), dict(aliases or {}))


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string a field selector compares: bools as true/false, absent as ""."""
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, Mapping) or part not in current:
            return ""
        current = current[part]
    if isinstance(current, bool):
        return "true" if current else "false"
    if current is None or isinstance(current, (dict, list)):
        return ""
    return str(current)
