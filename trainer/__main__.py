"""``torchrun ... -m trainer --config train.yaml [--set a.b=value ...]`` (or ``regroup-train``).

The edge of the trainer: reads argv and the environment once, configures logs and
traces, and runs one ``TrainingRun``. Exits 0 when max_steps is reached, 128+signal
when stopped, 2 on a bad configuration, 1 on any other failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from datetime import timedelta

import structlog

from regroup.failures import failure_kind, record_failure
from regroup.telemetry import configure_logging, configure_tracing
from trainer.batching import BatchSplitError
from trainer.config import ConfigError, load_config
from trainer.stopping import StopSignal, hard_exit

log = structlog.get_logger("regroup.trainer")

_LAST_WORDS = timedelta(milliseconds=500)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="regroup-train", description="FSDP2 trainer that survives resizes.")
    parser.add_argument("--config", help="YAML or JSON config file (default: all defaults)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set batch.global_batch_size=24 (repeatable)",
    )
    return parser


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    configure_logging(stream=LineAtomicStderr())
    rank = int(env.get("RANK", "0"))
    structlog.contextvars.bind_contextvars(rank=rank)
    try:
        cfg = load_config(args.config, args.overrides, env)
    except ConfigError as exc:
        log.error("bad configuration", error=str(exc))
        print(f"regroup-train: {exc}", file=sys.stderr)
        return 2

    # Imported after the config is known good: torch takes seconds to import.
    from trainer.control import JobChannel
    from trainer.distributed import init_runtime
    from trainer.loop import RunInfo, TrainingRun

    stop = StopSignal()
    # Under torchrun, a worker outliving its agent is an orphan nobody will stop.
    stop.install(orphan_check=timedelta(seconds=1) if "TORCHELASTIC_RUN_ID" in env else None)
    provider = configure_tracing("regroup-trainer") if rank == 0 else None
    channel: JobChannel | None = None
    code = 1
    try:
        runtime = init_runtime(env, cfg.device, timeout=timedelta(minutes=10))
        if cfg.etcd is not None and runtime.rank == 0:
            channel = JobChannel(cfg.etcd)
            channel.start()
        info = RunInfo(restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        try:
            run = TrainingRun(cfg, runtime, info, stop, channel)
        except BatchSplitError as exc:
            log.error("bad configuration", error=str(exc))
            print(f"regroup-train: {exc}", file=sys.stderr)
            code = 2
        else:
            if channel is not None:
                final = channel  # the watchdog's last act: the last completed step, briefly
                stop.on_force(lambda: final.publish_progress(run.last_words(), wait=True, timeout=_LAST_WORDS))
            code = run.run()
    except Exception as exc:
        code = 1
        record_failure(exc, env)
        try:
            log.exception("training failed", failure=failure_kind(exc))
        except OSError:
            pass  # stderr gone with the agent
    finally:
        try:
            if channel is not None:
                channel.close()
            if provider is not None:
                provider.shutdown()
        finally:
            # Exit without joining gloo/DCP threads or tearing down groups whose peers may be gone.
            hard_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
