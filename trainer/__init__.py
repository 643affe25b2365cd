"""regroup's FSDP2 trainer: survives resizes with reshardable checkpoints.

- ``config``: the settings tree, parsed once from YAML/JSON, env and ``--set``.
- ``model``: the Llama-style decoder; ``distributed``: process groups and FSDP2 sharding.
- ``data`` and ``batching``: samples by global index; a constant global batch split per world.
- ``checkpoint``: committed, reshardable DCP checkpoints; ``schedule``: the learning rate.
- ``boundary``: the per-step agreement; ``control``: etcd requests, acks and progress.
- ``stopping``: prompt stops on SIGTERM; ``loop``: the training run; ``__main__``: the CLI.
"""
