"""torchrun's ``etcd-v3`` rendezvous backend (DESIGN contract 2).

- ``settings``: ``--rdzv-conf`` and the environment, parsed once.
- ``decisions``: join/close/wait and ``num_nodes_waiting`` as pure functions of the job's view.
- ``watch``: the live mirror of the job's etcd keys that decisions read.
- ``agent``: one agent's leased keys and round closes (the writes).
- ``store``: the per-round agent store kept in etcd.
- ``handler``: ``EtcdV3RendezvousHandler``, torch's interface over the above.
- ``registration``: the ``torchrun.handlers`` entry point.
"""

if __name__ != "regroup.rendezvous":  # the folder imported by its own name, e.g. from the repository root
    raise ImportError(f"import regroup.rendezvous, not {__name__}: regroup installs under the one import name regroup")
