"""``python -m bench reform [--quick]``: in-place re-forms vs restarting the workers vs plain torchrun vs torchft.

Plays one demo scenario (``default`` unless ``--scenario``) in each mode in one run, one
mode after the other on the same machine:

- ``regroup``: ``regroup-run --standby`` with the controller; workers survive a re-form
  in place (same process, new process group);
- ``regroup-spares``: the same on the scenario with two more nodes, which the job keeps as
  warm spares (``spare_nodes: 2``): a reclaim or a loss is answered by a waiting node, in
  the leaving node's position, at the same size, as long as a spare is left (two, so that
  the default scenario's loss, which comes while the reclaimed node is away, finds one);
- ``regroup-restart``: the same rendezvous and controller, plain torchrun agents: every
  re-form restarts every worker;
- ``torchrun-c10d``: plain torchrun, c10d rendezvous, no controller;
- ``torchft`` (where torchft 0.2.0 is installed; ``torchft-hb1`` on request): the same
  kill and rejoin on torchft, one replica group per node under a torchft lighthouse
  (``torchft_peer``); it has no planned leave, join window or cordon, and its result says
  what it could not play.

For each mode it measures, from the recorded run (``regroup.demo.analysis``):

- planned reclaim: the reclaim taint -> the first training step at one node fewer, and
  the steps lost;
- abrupt loss: the kill -> the first training step at one node fewer;
- where a spare waited (the size the script implies is unchanged), their own rows: a
  reclaim is a migrate, from the taint to the first step on the spare, and a loss a
  replace, from the kill to the first step at the same size (the first step of the new
  round), each with its lost steps;
- grow: the moment the join window closed (the grow plan's ``decided_at``; without a
  controller, the restore plus the scenario's join window) -> the first training step
  at the larger size;
- flaky node: seconds without training after the flaky event, and its lost steps;
- goodput;
- for the controlled modes, how each new world was reached (``in-place`` or
  ``restart``) and where its resume time went, as the trainer reported it.

Every number is shown with its ratio to the in-place mode measured in the same run, and
beside the goal. The tables go to stdout, ``reform.md`` and ``reform.json`` in the run
folder. ``--quick`` shortens the run to 110 s and leaves out the events that no longer
fit (the flaky node). ``--runs`` tabulates recorded run folders again.

``play`` drives the scenario in each mode, ``report`` measures the recorded runs and
tabulates them, ``cli`` is the command; ``torchft_peer``, ``torchft_replica``,
``torchft_lighthouse`` and ``torchft_measure`` are the torchft modes.
"""


def main(argv: list[str]) -> int:
    """``python -m bench reform``. Imported on call: the torchft replicas and lighthouse
    run as ``python -m bench.reform.<module>``, and importing the package must not load
    the whole benchmark into each of them."""
    from bench.reform.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
