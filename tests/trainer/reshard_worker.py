"""torchrun worker for the reshard test: load the newest checkpoint at this world size
(or train two steps if there is none), dump the full unsharded state, then save it as
the next step with an async save while a training step runs on (the step overlaps the
background copy and changes every parameter once it may). The next world size loads
that save, so its dump shows whether the async snapshot was the state at save time.
``python -m tests.trainer.reshard_worker CONFIG OUT``."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from regroup.trainer.config_loading import load_config
from regroup.trainer.distributed import init_runtime
from regroup.trainer.loop import RunInfo, TrainingRun
from regroup.trainer.stopping import StopSignal, hard_exit


def main(config: str, out: str) -> None:
    env = dict(os.environ)
    cfg = load_config(config, env=env)
    runtime = init_runtime(env, "cpu", timeout=timedelta(minutes=2))
    run = TrainingRun(cfg, runtime, RunInfo(), StopSignal(), None)
    assert run.checkpointer is not None
    run.checkpointer.prepare()
    if run.checkpointer.load_latest(run.app) is None:
        run.train_step()
        run.train_step()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(run.model, run.optimizer, options=options)
    if runtime.rank == 0:
        torch.save({"model": model_state, "optim": optim_state["state"], "step": run.state.step}, out)
    run.state.step += 1
    run.save(wait=False)
    run.train_step()
    run.checkpointer.finish()
    dist.barrier(group=runtime.control_group)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    hard_exit(0)
