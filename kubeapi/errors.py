"""API errors as the real server reports them: a `metav1.Status` body with a code and a reason."""

from __future__ import annotations

from typing import Any

# The reasons metav1 gives each HTTP code (k8s.io/apimachinery/pkg/apis/meta/v1/types.go).
REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Gone",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """A request the API server refuses; `status()` is the body it answers with."""

    def __init__(
        self, code: int, message: str, *, reason: str | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = REASONS.get(code, "Unknown") if reason is None else reason
        """The Status reason; "" for a Status that carries none (a handler's own failure Status)."""
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if not self.reason:
            del body["reason"]
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(qualified: str, name: str, group: str, plural: str) -> ApiError:
    return ApiError(404, f'{qualified} "{name}" not found', details=_details(name, group, plural))


def already_exists(qualified: str, name: str, group: str, plural: str) -> ApiError:
    return ApiError(
        409, f'{qualified} "{name}" already exists', reason="AlreadyExists", details=_details(name, group, plural)
    )


def conflict(qualified: str, name: str, group: str, plural: str, why: str) -> ApiError:
    return ApiError(
        409, f'Operation cannot be fulfilled on {qualified} "{name}": {why}', details=_details(name, group, plural)
    )


def invalid(kind: str, name: str, group: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422 Invalid; each cause is (field, reason, message) as field.ErrorList renders it."""
    text = "; ".join(f"{field}: {message}" for field, _, message in causes)
    details: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "causes": [{"reason": reason, "message": message, "field": field} for field, reason, message in causes],
    }
    if group:
        details["group"] = group
    shown = f'{kind}.{group} "{name}"' if group else f'{kind} "{name}"'
    return ApiError(422, f"{shown} is invalid: {text}", details=details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def expired(message: str) -> ApiError:
    return ApiError(410, message, reason="Expired")


def _details(name: str, group: str, plural: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": plural}
    if group:
        details["group"] = group
    return details
