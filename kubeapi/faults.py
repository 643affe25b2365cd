"""Failures injected into the stand-in's answers (``FakeKubeAPI.fail_next``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubeapi.errors import ApiError


@dataclass
class _Rule:
    method: str
    path: re.Pattern[str]
    status: int
    remaining: int
    watch: bool | None


class FailureRules:
    """The requests still to fail, in the order the rules were added."""

    def __init__(self) -> None:
        self._rules: list[_Rule] = []

    def add(self, method: str, path_regex: str, status: int, times: int, watch: bool | None) -> None:
        if times < 1:
            raise ValueError(f"times: must be at least 1, got {times}")
        if not 400 <= status <= 599:
            raise ValueError(f"status: must be an HTTP error code, got {status}")
        self._rules.append(_Rule(method.upper(), re.compile(path_regex), status, times, watch))

    def check(self, method: str, path: str, is_watch: bool) -> None:
        """Raise the injected error if a rule matches this request (and count it down)."""
        for rule in self._rules:
            if rule.method not in ("*", method) or not rule.path.search(path):
                continue
            if rule.watch is not None and rule.watch != is_watch:
                continue
            rule.remaining -= 1
            if rule.remaining == 0:
                self._rules.remove(rule)
            raise ApiError(rule.status, f"injected failure for {method} {path}")
