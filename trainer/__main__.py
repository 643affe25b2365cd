"""``torchrun ... -m regroup.trainer --config train.yaml [--set a.b=value ...]`` (or ``regroup-train``).

The edge of the trainer: reads argv and the environment once, configures logs and
traces, and runs one ``TrainingRun`` (the built-in trainer on ``regroup.elastic``). Exits 0 when max_steps is reached, 128+signal
when stopped, 2 on a bad configuration, 1 on any other failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from regroup.exit_codes import hard_exit  # no torch: safe before the handler


def _stopped_while_starting(signum: int, frame: object) -> None:
    """SIGINT before the run takes signals over (an agent stopping a worker that is still
    importing torch): exit 128+signal at once and quietly. Not with an exception: raised in
    the middle of an import it surfaces as a traceback (``KeyboardInterrupt``, or wrapped by
    the import machinery, as a ``SystemExit`` inside a class body becomes a ``RuntimeError``).
    Nothing has started yet that an exit could cut short."""
    hard_exit(128 + signum)


signal.signal(signal.SIGINT, _stopped_while_starting)

import structlog  # noqa: E402 - after the handler: the imports below take seconds

from regroup.failures import failure_kind, record_failure  # noqa: E402
from regroup.telemetry import LineAtomicStderr, configure_logging  # noqa: E402
from regroup.elastic.world.batching import BatchSplitError  # noqa: E402
from regroup.elastic.settings import ConfigError  # noqa: E402
from regroup.trainer.config_loading import load_config  # noqa: E402

log = structlog.get_logger("regroup.trainer")


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    configure_logging(stream=LineAtomicStderr())
    structlog.contextvars.bind_contextvars(rank=int(env.get("RANK", "0")))
    try:
        cfg = load_config(args.config, args.overrides, env)
    except ConfigError as exc:
        log.error("bad configuration", error=str(exc))
        print(f"regroup-train: {exc}", file=sys.stderr)
        return 2

    # Imported after the config is known good: torch takes seconds to import.
    from regroup.rendezvous.inplace.membership import ReformFailed
    from regroup.trainer.loop import TrainingRun

    code = 1
    try:
        code = TrainingRun(cfg).train()
    except (BatchSplitError, ConfigError) as exc:  # e.g. no host memory for the snapshots
        log.error("bad configuration", error=str(exc))
        print(f"regroup-train: {exc}", file=sys.stderr)
        code = 2
    except ReformFailed as exc:
        # Not this node's fault (recorded as such): its agent restarts this worker the usual way.
        code = 1
        record_failure(RuntimeError(f"Connection closed by peer: in-place re-form failed: {exc}"), env)
    except Exception as exc:
        code = 1
        record_failure(exc, env)
        try:
            log.exception("training failed", failure=failure_kind(exc))
        except OSError:
            pass  # stderr gone with the agent
    finally:
        # Exit without joining gloo/DCP threads or tearing down groups whose peers may be gone.
        hard_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
