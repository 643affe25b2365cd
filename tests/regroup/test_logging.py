"""Log events leave whole: an agent and its workers share one log file or pipe, so each
event's line and its newline go out in one ``write``, never split around another
process's line (``print`` writes the text and the newline apart)."""

from __future__ import annotations

import json

import structlog

from regroup.telemetry import configure_logging


class Writes:
    """A stream that keeps each ``write`` call apart."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered: each write is kept as it came."""


def test_each_event_is_one_write_of_its_whole_line() -> None:
    stream = Writes()
    configure_logging(stream=stream)
    try:
        log = structlog.get_logger("regroup.test")
        log.info("workers left their world; leaving the job", seconds=0.041)
        log.warning("leaving a job that goes on", exit_code=75)
    finally:
        configure_logging()
    assert len(stream.calls) == 2, stream.calls
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in stream.calls), stream.calls
    assert [json.loads(call)["event"] for call in stream.calls] == [
        "workers left their world; leaving the job", "leaving a job that goes on",
    ]  # fmt: skip
