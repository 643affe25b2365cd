"""regroup: what the parts share (etcd key layout, records, etcd access, telemetry, free ports) and the CLI.

Nothing in this package imports torch.
"""

__version__ = "0.1.0"
