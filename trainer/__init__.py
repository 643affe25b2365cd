"""regroup's FSDP2 trainer: survives resizes with reshardable checkpoints.

- ``config``: the settings tree; ``config_loading`` builds it once from YAML/JSON, env and
  ``--set``, converting values by type (``config_parsing``).
- ``model``: the Llama-style decoder; ``distributed``: process groups and FSDP2 sharding.
- ``data`` and ``batching``: samples by global index; a constant global batch split per world.
- ``checkpoint``: committed, reshardable DCP checkpoints (``checkpoint_folders``: the
  ``step-N`` folders, their marker and retention; ``app_state``: what is saved;
  ``host_copy``: the async save's copy to host memory); ``schedule``: the learning rate.
- ``snapshot``: in-memory snapshots (``snapshot_layout``, ``snapshot_cost``); ``reshard``
  and ``handoff``: state rebuilt in memory for a new world.
- ``boundary``: the per-step agreement; ``control``: etcd requests, acks and progress.
- ``stopping``: prompt stops on SIGTERM; ``loop``: the training run, with ``progress``,
  ``checkpoint_requests`` and ``inplace_reform``; ``__main__``: the CLI.
"""

if __name__ != "regroup.trainer":  # the folder imported by its own name, e.g. from the repository root
    raise ImportError(f"import regroup.trainer, not {__name__}: regroup installs under the one import name regroup")
