"""``torchrun ... -m regroup.trainer --config train.yaml [--set a.b=value ...]`` (or ``regroup-train``).

The edge of the trainer: reads argv and the environment once, configures logs and
traces, and runs one ``TrainingRun``. Exits 0 when max_steps is reached, 128+signal
when stopped, 2 on a bad configuration, 1 on any other failure.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import structlog

from regroup.failures import failure_kind, record_failure
from regroup.telemetry import configure_logging, configure_tracing
from regroup.trainer.batching import BatchSplitError
from regroup.trainer.config import ConfigError
from regroup.trainer.config_loading import load_config
from regroup.trainer.stopping import StopSignal, hard_exit

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
    started = time.perf_counter()
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
    from regroup.rendezvous.inplace.membership import ReformFailed
    from regroup.rendezvous.inplace.world import ElasticWorld
    from regroup.trainer.control import JobChannel
    from regroup.trainer.distributed import backend_for, pick_device, runtime_on_default_group
    from regroup.trainer.loop import RunInfo, TrainingRun

    stop = StopSignal()
    # Under torchrun, a worker outliving its agent is an orphan nobody will stop.
    stop.install(orphan_check=timedelta(seconds=1) if "TORCHELASTIC_RUN_ID" in env else None)
    provider = configure_tracing("regroup-trainer") if rank == 0 else None
    channel: JobChannel | None = None
    code = 1
    world = None
    try:
        device = pick_device(cfg.device, int(env.get("LOCAL_RANK", "0")))
        startup_s = time.perf_counter() - started
        timeout = timedelta(minutes=10)
        # Under regroup-run this process may outlive its world (ElasticWorld); under plain
        # torchrun it is init_process_group from the environment.
        world = ElasticWorld.join(
            backend_for(device),
            timeout=timeout,
            abort_grace=cfg.reform.abort_grace,
            keep_ports=etcd_ports(cfg),
            env=env,
            stop=lambda: stop.requested,
        )
        structlog.contextvars.bind_contextvars(rank=world.rank)
        built = time.perf_counter()
        runtime = runtime_on_default_group(world.local_rank, device, timeout)
        process_group_s = world.last_process_group_s + time.perf_counter() - built

        def open_channel() -> JobChannel:
            assert cfg.etcd is not None
            opened = JobChannel(cfg.etcd)
            opened.start()
            return opened

        if cfg.etcd is not None and runtime.rank == 0:
            channel = open_channel()
        info = RunInfo(
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            # The topology init container exports the node's zone; REGROUP_FAILURE_DOMAIN overrides it.
            place=(
                env.get("REGROUP_FAILURE_DOMAIN") or env.get("REGROUP_ZONE", ""),
                env.get("NODE_NAME") or socket.gethostname(),
            ),
            ranks_on_node=int(env.get("LOCAL_WORLD_SIZE", "1")),
        )
        try:
            run = TrainingRun(
                cfg, runtime, info, stop, channel, world=world, open_channel=open_channel if cfg.etcd else None
            )
            run.change.add("startup", startup_s)
            run.change.add("process_group", process_group_s)
        except (BatchSplitError, ConfigError) as exc:  # e.g. no host memory for the snapshots
            log.error("bad configuration", error=str(exc))
            print(f"regroup-train: {exc}", file=sys.stderr)
            code = 2
        else:
            if channel is not None:
                final = channel  # the watchdog's last act: the last completed step, briefly
                stop.on_force(lambda: final.publish_progress(run.last_words(), wait=True, timeout=_LAST_WORDS))
            code = run.run()
            channel = run.channel
    except ReformFailed as exc:
        # Not this node's fault: its agent restarts this worker the usual way (the fallback).
        code = 1
        record_failure(RuntimeError(f"Connection closed by peer: in-place re-form failed: {exc}"), env)
        log.error("in-place re-form failed; falling back to a restart", error=str(exc))
    except Exception as exc:
        code = 1
        record_failure(exc, env)
        try:
            log.exception("training failed", failure=failure_kind(exc))
        except OSError:
            pass  # stderr gone with the agent
    finally:
        try:
            if world is not None:
                world.close()
            if channel is not None:
                channel.close()
            if provider is not None:
                provider.shutdown()
        finally:
            # Exit without joining gloo/DCP threads or tearing down groups whose peers may be gone.
            hard_exit(code)
    return code


def etcd_ports(cfg: object) -> list[int]:
    """Ports of the job's etcd endpoints: connections to them survive a re-form."""
    etcd = getattr(cfg, "etcd", None)
    if etcd is None:
        return []
    ports = []
    for endpoint in etcd.endpoint.split(","):
        _, _, port = endpoint.strip().rpartition(":")
        if port.isdigit():
            ports.append(int(port))
    return ports


if __name__ == "__main__":
    sys.exit(main())
