"""One torchft replica group of ``bench reform``'s torchft mode: a single process (1 rank,
gloo, CPU, loopback) that trains the demo's model under a ``torchft.Manager``.

``python -m bench.reform.torchft_replica --replica node-2 --lighthouse http://127.0.0.1:PORT ...``

Each step: ``start_quorum``, forward and backward, one ``manager.allreduce`` of the flat
gradient, then ``should_commit``; the optimizer steps only on a commit, and every
committed step is one JSON line in the shared step log (``StepRecord``). torchft's
``DistributedDataParallel`` is not used: its comm hook (0.2.0) assumes the allreduce went
through and asserts on the manager's inner future, which is unset when the allreduce
failed (a peer died during it), so the replica would end there; driven directly, the
manager's allreduce reports the error and the step is simply not committed.

The model, the synthetic tokens and the step-time floor are the built-in trainer's
(``regroup.trainer.model.Decoder``, ``regroup.trainer.data.SyntheticTokens``), with the
sizes the parent passes in, so a step costs what a demo step costs.

A fresh replica recovers the model and optimizer from a peer (torchft's HTTP checkpoint
transport, on 127.0.0.1 here) and goes on from the peers' step. ``--crash-after-steps N``
makes it SIGKILL itself after its N-th committed step: the flaky node of a scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any, TypedDict

LOOPBACK = "127.0.0.1"


class StepRecord(TypedDict):
    """One committed step of one replica, as a line of the step log."""

    time: float
    """Unix seconds when ``should_commit`` returned True."""
    step: int
    """The manager's step after the commit (the first step is 1)."""
    participants: int
    """Replicas whose gradients this step averaged (``Manager.num_participants``)."""
    replica: str
    """The replica's node name."""
    quorum: int
    """The lighthouse's quorum id this step was committed in (a new one on each re-form)."""
    pid: int
    """The replica's process: a new one on each restart."""
    loss: float


def append_record(fd: int, record: StepRecord) -> None:
    """One ``write`` per line on an ``O_APPEND`` descriptor: lines of the replicas sharing
    the log never interleave."""
    os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reform.torchft_replica", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--replica", required=True, help="replica id: the scenario node's name")
    parser.add_argument("--index", type=int, required=True, help="the node's position in the scenario (its data shard)")
    parser.add_argument("--nodes", type=int, required=True, help="the scenario's node count (data shards)")
    parser.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--steps-log", required=True, help="JSON-lines file shared by every replica")
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--model", required=True, help="regroup.trainer.config.ModelConfig fields, as JSON")
    parser.add_argument("--batch", type=int, required=True, help="samples per replica per step")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--step-floor", type=float, required=True, help="pad each step to this many seconds")
    parser.add_argument("--timeout", type=float, required=True, help="the manager's and gloo's timeout, seconds")
    parser.add_argument(
        "--crash-after-steps", type=int, default=0, help="SIGKILL itself after this many commits (0: never)"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport

    from regroup.trainer.config import ModelConfig
    from regroup.trainer.data import SyntheticTokens, batch
    from regroup.trainer.model import Decoder

    class LoopbackTransport(HTTPTransport[dict[str, Any]]):
        """torchft's HTTP checkpoint transport, advertised on 127.0.0.1 instead of the host name."""

        def address(self) -> str:
            return f"http://{LOOPBACK}:{self._server.socket.getsockname()[1]}/checkpoint/"

    torch.set_num_threads(1)
    config = ModelConfig(**json.loads(args.model))
    model = Decoder(config)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = SyntheticTokens(config.vocab_size, config.seq_len, seed=0)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    # The replica group's own store: one rank, so this process is its master.
    store = TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        rank=0,
        world_size=1,
        store_addr=LOOPBACK,
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=args.replica,
        hostname=LOOPBACK,
        checkpoint_transport=LoopbackTransport(timeout=timeout, num_chunks=0),
    )
    log = os.open(args.steps_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    committed = 0
    try:
        while True:
            started = time.perf_counter()
            manager.start_quorum()
            optimizer.zero_grad()
            step = manager.current_step()
            first = (step * args.nodes + args.index) * args.batch
            inputs, targets = batch(tokens, range(first, first + args.batch))
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            if manager.should_commit():
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                committed += 1
                record: StepRecord = {
                    "time": time.time(),
                    "step": manager.current_step(),
                    "participants": manager.num_participants(),
                    "replica": args.replica,
                    # torchft 0.2.0 has no public accessor for the quorum id.
                    "quorum": int(getattr(manager, "_quorum_id", 0)),
                    "pid": os.getpid(),
                    "loss": float(loss),
                }
                append_record(log, record)
                if args.crash_after_steps and committed >= args.crash_after_steps:
                    os.kill(os.getpid(), signal.SIGKILL)
            left = args.step_floor - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)
    finally:
        os.close(log)
        manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
