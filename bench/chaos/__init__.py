"""``python -m bench chaos [--quick] [--seed S] [--faults N]``: a seeded fault-injection campaign.

One job (4 local nodes, min 2, max 4, one rank each; real etcd, torchrun agents with
in-place re-forms, FSDP2/gloo trainers, the controller in this process) takes a seeded
series of faults: SIGKILLs of a node or of a rank mid-step, during a checkpoint save,
during a rendezvous and between a checkpoint ack and the re-form; etcd restarts; the
controller cancelled mid re-form and replaced; a dropped cluster watch and its relist;
a reclaim notice shorter than a checkpoint. After each fault the campaign waits for the
job to train again and restores the nodes it took. Then it checks seven invariants over
what the run recorded and prints, per fault kind: faults, recovered, time to recover
(p50/p99), steps lost and violations. ``plan`` draws the faults, ``job`` owns the
processes, ``faults`` injects, ``observe`` watches, ``invariants`` checks, ``campaign``
runs a cycle per fault, ``report`` tabulates, ``cli`` is the command.
"""

from bench.chaos.cli import main

__all__ = ["main"]
