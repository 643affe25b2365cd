"""In-place re-forms: workers survive a membership change instead of being restarted.

- ``channel``: the files through which a node's agent and its workers talk (no torch);
- ``agent``: a torchrun ``LocalElasticAgent`` that re-forms its running workers in place;
- ``launcher``: ``regroup-run``, torchrun with that agent (same flags, same worker env);
- ``world``: ``ElasticWorld``, what a training script calls to take part;
- ``abort``: making a collective that waits on a dead or hung peer fail, not hang.
"""
