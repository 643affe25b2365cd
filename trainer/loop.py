"""The built-in trainer's loop: a Llama-style decoder, FSDP2, AdamW with a cosine schedule,
on the public API (``regroup.elastic``) like any user's script.

Everything elastic (the world and its re-forms, the step boundary, checkpoint requests,
snapshots, progress, the sample order) is the API's; this module holds only what makes the
built-in trainer a trainer: its model, optimizer, data and learning rate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regroup import elastic
from regroup.trainer.config import TrainConfig
from regroup.trainer.data import batch, make_source
from regroup.trainer.sharding import build_sharded_model
from regroup.trainer.schedule import lr_at


class TrainingRun:
    """The built-in trainer in one process."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.options = options_for(cfg)
        self.source = make_source(cfg.data, cfg.model)

    def train(self) -> int:
        """Train to ``max_steps`` or until stopped, re-forming in place; the exit code."""
        try:
            elastic.in_place(self.train_in_world, options=self.options)()
        except SystemExit as ended:  # stopped (128+signal), or this node left the job (0)
            return int(ended.code or 0)
        return 0

    def train_in_world(self) -> None:
        """One world: the decoder sharded over it, AdamW, and the steps (called again after
        each in-place re-form; the run restores the state into the new model)."""
        cfg = self.cfg
        world = elastic.world()
        torch.manual_seed(cfg.seed)
        model = build_sharded_model(cfg.model, cfg.seed, world.mesh, world.device)
        o = cfg.optim
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
        for step in elastic.Run(model, optimizer, options=self.options):
            lr = lr_at(step.index, o, cfg.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens = step.micro_batch * cfg.model.seq_len
            total = torch.zeros((), dtype=torch.float32, device=world.device)
            for ids in step.micro_batches():
                inputs, targets = batch(self.source, ids)
                logits = model(inputs.to(world.device))
                loss = F.cross_entropy(
                    logits.flatten(0, 1).float(), targets.to(world.device).flatten(), reduction="sum"
                ) / (tokens * step.accumulation)
                loss.backward()
                total += loss.detach()
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step.report(total, tokens=tokens * step.accumulation)


def options_for(cfg: TrainConfig) -> elastic.Options:
    """The run's settings, taken from the trainer's config (it holds the run's sections)."""
    return elastic.Options.of(cfg, sample_log=cfg.data.sample_log, seed=cfg.seed)
