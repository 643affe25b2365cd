"""PodDisruptionBudgets (policy/v1): what the API server validates of one, which pods it
covers, and whether it lets the eviction subresource take one of them.

The real eviction handler reads the budget's status, which the disruption controller keeps
(`disruptionsAllowed`, `desiredHealthy`, `currentHealthy`). No controller runs beside the
stand-in, so the eviction computes those numbers from the pods at that moment, as the
controller would, with one simplification: the expected pod count is the number of pods
the selector matches now (no workload controllers are served, so their replica counts are
unknown).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from kubeapi.errors import ApiError
from kubeapi.selectors import LabelSelector, selector_from_object

_PERCENT = re.compile(r"^[0-9]+%$")
UNHEALTHY_POD_EVICTION_POLICIES = ("AlwaysAllow", "IfHealthyBudget")


def budget_causes(obj: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Validation failures of a PodDisruptionBudget, as (field, reason, message)."""
    spec = obj.get("spec") or {}
    if not isinstance(spec, dict):
        return [("spec", "FieldValueInvalid", "Invalid value: spec must be an object")]
    causes: list[tuple[str, str, str]] = []
    if spec.get("minAvailable") is not None and spec.get("maxUnavailable") is not None:
        causes.append(
            ("spec", "FieldValueInvalid", "Invalid value: minAvailable and maxUnavailable cannot be both set")
        )
    for name in ("minAvailable", "maxUnavailable"):
        value = spec.get(name)
        if value is not None:
            causes.extend(
                (f"spec.{name}", "FieldValueInvalid", f"Invalid value: {value!r}: {why}")
                for why in _int_or_percent_errors(value)
            )
    try:
        selector_from_object(spec.get("selector"))
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        causes.append((f"spec.{field}", "FieldValueInvalid", f"Invalid value: {why}"))
    policy = spec.get("unhealthyPodEvictionPolicy")
    if policy is not None and policy not in UNHEALTHY_POD_EVICTION_POLICIES:
        supported = ", ".join(f'"{p}"' for p in UNHEALTHY_POD_EVICTION_POLICIES)
        causes.append(
            (
                "spec.unhealthyPodEvictionPolicy",
                "FieldValueNotSupported",
                f'Unsupported value: "{policy}": supported values: {supported}',
            )
        )
    return causes


def _int_or_percent_errors(value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return ["must be an integer or percentage (e.g '5%')"]
    if isinstance(value, int):
        return ["must be greater than or equal to 0"] if value < 0 else []
    if not _PERCENT.match(value):
        return [
            "a valid percent string must be a numeric string followed by an ending '%' "
            "(e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')"
        ]
    return ["must not be greater than 100%"] if int(value[:-1]) > 100 else []


def scaled(value: int | str, total: int) -> int:
    """An int-or-percent against `total`, percentages rounded up (GetScaledValueFromIntOrPercent)."""
    if isinstance(value, int):
        return value
    return math.ceil(int(value[:-1]) * total / 100)


def _selector(budget: dict[str, Any]) -> LabelSelector | None:
    """The budget's selector; None (matching no pod) when null or invalid."""
    try:
        return selector_from_object((budget.get("spec") or {}).get("selector"))
    except ValueError:
        return None


def covers(budget: dict[str, Any], pod: dict[str, Any]) -> bool:
    """Whether the budget's selector matches the pod (a null or invalid selector matches none)."""
    selector = _selector(budget)
    return selector is not None and selector.matches(pod["metadata"].get("labels"))


def is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (podutil.IsPodReady: what a budget counts as healthy)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def may_skip_budgets(pod: dict[str, Any]) -> bool:
    """Pods not running (yet or any more), or already terminating, are evicted without
    asking any budget (canIgnorePDB in the eviction handler)."""
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Pending", "Succeeded", "Failed") or bool(pod["metadata"].get("deletionTimestamp"))


def eviction_check(pod: dict[str, Any], budgets: list[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> None:
    """Raises what the eviction handler answers when the budgets covering `pod` (among its
    namespace's `budgets`, over its namespace's `pods`, read only when one covers it)
    refuse to let it go; returns when the eviction may proceed."""
    covering = [b for b in budgets if covers(b, pod)]
    if len(covering) > 1:
        # A failure Status the handler returns itself: code 500, no reason.
        raise ApiError(
            500,
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            reason="",
        )
    if not covering:
        return
    budget = covering[0]
    spec = budget.get("spec") or {}
    selector = _selector(budget)
    assert selector is not None
    matched = [p for p in pods if selector.matches(p["metadata"].get("labels"))]
    healthy = sum(1 for p in matched if is_ready(p) and not p["metadata"].get("deletionTimestamp"))
    expected = len(matched)
    if spec.get("maxUnavailable") is not None:
        desired = max(expected - scaled(spec["maxUnavailable"], expected), 0)
    elif spec.get("minAvailable") is not None:
        desired = scaled(spec["minAvailable"], expected)
    else:
        desired = 0
    if not is_ready(pod):
        # An unready pod does not count as healthy: evicting it costs the budget nothing
        # unless the application is already disrupted (IfHealthyBudget, the default).
        if spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow":
            return
        if healthy >= desired > 0:
            return
    if healthy - desired <= 0:
        raise budget_refusal(budget["metadata"]["name"], desired, healthy)


def budget_refusal(name: str, desired: int, healthy: int) -> ApiError:
    """429 TooManyRequests with the DisruptionBudget cause, as checkAndDecrement answers."""
    return ApiError(
        429,
        "Cannot evict pod as it would violate the pod's disruption budget.",
        details={
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": f"The disruption budget {name} needs {desired} healthy pods and has {healthy} currently",
                }
            ]
        },
    )
