"""regroup's public API for a user's own training loop (FSDP2, DDP or one rank).

::

    from regroup import elastic

    @elastic.in_place                       # under regroup-run, called again after each re-form
    def main():
        world = elastic.world()             # rank, world_size, device, mesh of the current world
        model = MyModel()
        fully_shard(model, mesh=world.mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        for step in elastic.Run(model, optimizer, global_batch=64, max_steps=1000):
            for ids in step.micro_batches():                # global sample ids of this rank
                loss = loss_of(model, dataset[ids]) / step.accumulation
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step.report(loss)               # the next step's request is the agreed step boundary

    main()

What the script gets: the world joined and re-formed in place under ``regroup-run``
(restarts under torchrun); the controller's checkpoint requests honoured at a step boundary
(DCP, committed, acked, held for the re-form); progress published for the controller and
``regroup status``; in-memory snapshots with a buddy copy and a reshard in memory on a
re-form; a constant global batch in an order that depends only on the global sample index;
the trainer half of every re-form trace. A ``DataLoader`` over ``elastic.Sampler`` takes the
place of ``DistributedSampler`` (``for epoch in run.epochs(): for batch in
run.batches(loader):``); ``elastic.keyed_dropout(model)`` makes dropout a function of the
sample, not of the rank. The guide is docs/your-script.md.
"""

if __name__ != "regroup.elastic":  # the folder imported by its own name, e.g. from the repository root
    raise ImportError(f"import regroup.elastic, not {__name__}: regroup installs under the one import name regroup")

from regroup.rendezvous.inplace.membership import Reform
from regroup.elastic.data import Sampler
from regroup.elastic.options import Options
from regroup.elastic.randomness import Dropout, dropout, generator, keyed_dropout, samples
from regroup.elastic.run import Run, Step
from regroup.elastic.settings import ConfigError
from regroup.elastic.session import in_place, world
from regroup.elastic.state import MisuseError, World

__all__ = [
    "ConfigError",
    "Dropout",
    "MisuseError",
    "Options",
    "Reform",
    "Run",
    "Sampler",
    "Step",
    "World",
    "dropout",
    "generator",
    "in_place",
    "keyed_dropout",
    "samples",
    "world",
]
