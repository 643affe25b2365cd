"""Logs and traces, configured once at each process's edge.

- structlog JSON logs, one event per line, with ``trace_id``/``span_id`` when a span is active.
- OpenTelemetry tracing: OTLP/HTTP when the standard ``OTEL_EXPORTER_OTLP_*`` variables
  are set; a JSON-lines file of OTLP JSON spans when ``REGROUP_SPANS_FILE`` is set (local
  runs, ``regroup trace-report``); both may be active.
- W3C ``traceparent`` helpers, so a trainer's spans join the controller's trace through etcd.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from google.protobuf.json_format import MessageToDict
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SPANS_FILE_ENV = "REGROUP_SPANS_FILE"
_propagator = TraceContextTextMapPropagator()


def _add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(level: str | None = None, stream: Any = None, *, once: bool = False) -> None:
    """structlog JSON to ``stream`` (stderr by default), one event per line, each line and its
    newline in one ``write``: an agent and its workers share one log file or pipe, and a line
    sent in two writes (``print``'s way) could take another process's line between them.

    ``once``: this process configures logging once and for all (the controller), so each
    logger is built on first use and cached, instead of on every call (which a process that
    reconfigures logging, e.g. for each local run, needs)."""
    level_name = (level or os.environ.get("REGROUP_LOG_LEVEL", "info")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=once,
    )


class LineAtomicStderr:
    """stderr for log events: each line leaves in one ``write(2)``, so the lines of ranks
    that share the agent's pipe never interleave mid-line (pipes keep writes of up to
    4 KiB whole; ``print`` would send the text and its newline separately)."""

    def __init__(self, fd: int = 2) -> None:
        self._fd = fd
        self._pending = threading.local()

    def write(self, text: str) -> int:
        buffered = getattr(self._pending, "text", "") + text
        head, sep, rest = buffered.rpartition("\n")
        if sep:
            os.write(self._fd, (head + sep).encode(errors="replace"))
        self._pending.text = rest if sep else buffered
        return len(text)

    def flush(self) -> None:
        pending = getattr(self._pending, "text", "")
        if pending:
            self._pending.text = ""
            os.write(self._fd, pending.encode(errors="replace"))


class JsonLinesSpanExporter(SpanExporter):
    """Appends each export as one OTLP/JSON ``ExportTraceServiceRequest`` per line.

    Encoding is the OTLP exporter's own (``encode_spans``); ids are rewritten from the
    protobuf-JSON base64 to the hex that the OTLP/JSON spec requires. Several processes
    may append to one file: each export is one ``write`` under ``O_APPEND``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = MessageToDict(encode_spans(spans))
        for resource_spans in body.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in span:
                            span[key] = base64.b64decode(span[key]).hex()
        line = json.dumps(body, separators=(",", ":")) + "\n"
        with self._lock:
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Flatten a JSON-lines OTLP file into plain span dicts with decoded attributes."""

    def decode(value: Mapping[str, Any]) -> Any:
        if "intValue" in value:
            return int(value["intValue"])
        if "arrayValue" in value:
            return [decode(v) for v in value["arrayValue"].get("values", [])]
        for key in ("stringValue", "boolValue", "doubleValue"):
            if key in value:
                return value[key]
        return None

    spans: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        scope_spans_list = [
            ss for rs in json.loads(line).get("resourceSpans", []) for ss in rs.get("scopeSpans", [])
        ]
        for scope_spans in scope_spans_list:
            for s in scope_spans.get("spans", []):
                spans.append(
                    {
                        "trace_id": s["traceId"],
                        "span_id": s["spanId"],
                        "parent_span_id": s.get("parentSpanId"),
                        "name": s["name"],
                        "start_ns": int(s["startTimeUnixNano"]),
                        "end_ns": int(s["endTimeUnixNano"]),
                        "attributes": {a["key"]: decode(a["value"]) for a in s.get("attributes", [])},
                    }
                )
    return spans


def configure_tracing(service_name: str, spans_file: str | None = None) -> TracerProvider:
    """Install a global TracerProvider for this process and return it.

    Exporters: OTLP/HTTP if ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set; a JSON-lines file if ``spans_file``
    or ``REGROUP_SPANS_FILE`` is set. Call ``provider.shutdown()`` before exit to flush.
    """
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    path = spans_file or os.environ.get(SPANS_FILE_ENV)
    if path:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    trace.set_tracer_provider(provider)
    return provider


def inject_traceparent(span: trace.Span | None = None) -> str:
    """The W3C ``traceparent`` of ``span`` (or the current span), or "" if none."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _propagator.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context:
    """A context whose parent is the span named by ``traceparent`` (empty: a new root)."""
    if not traceparent:
        return otel_context.Context()
    return _propagator.extract({"traceparent": traceparent})
