"""regroup's built-in trainer: a Llama-style decoder under FSDP2, trained on the public API
(``regroup.elastic``) like any user's script.

- ``config``: its settings tree (the run's sections are ``regroup.elastic.settings``'s);
  ``config_loading`` builds it once from YAML/JSON, env and ``--set``.
- ``model``: the decoder; ``sharding``: FSDP2 over the world's mesh; ``data``: token
  sources where sample ``i`` depends on ``i`` only; ``schedule``: the learning rate.
- ``loop``: the training run on ``regroup.elastic``; ``__main__``: the CLI.
- ``elastic``: the public API's earlier import path, kept for one release.
"""

if __name__ != "regroup.trainer":  # the folder imported by its own name, e.g. from the repository root
    raise ImportError(f"import regroup.trainer, not {__name__}: regroup installs under the one import name regroup")
