"""What an agent host is told: the agents' and trainers' timing, and each job's placement.

Torch-free, so the benchmark's own process and the controller's never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class Timing:
    """The agents' and the trainer's settings (production defaults unless the command line says)."""

    lease_ttl: timedelta = timedelta(seconds=5)
    step_time: timedelta = timedelta(seconds=0.5)
    progress_interval: timedelta = timedelta(seconds=5)

    def conf(self) -> dict[str, str]:
        """``--rdzv-conf``: the rendezvous' defaults, not the rendezvous benchmark's."""
        return {"lease_ttl": f"{self.lease_ttl.total_seconds():g}", "join_timeout": "600", "last_call_timeout": "5"}


@dataclass(frozen=True)
class JobTls:
    """The files a job's workers present to an etcd with authentication on: the CA, and the
    job's own client certificate (CN ``regroup:job:<namespace>:<job>``, its etcd user)."""

    cacert: str
    cert: str
    key: str

    def rdzv_conf(self) -> dict[str, str]:
        """The agents' ``--rdzv-conf`` TLS keys (the ``etcd-v3`` handler's ``cacert``, ``cert``, ``key``)."""
        return {"cacert": self.cacert, "cert": self.cert, "key": self.key}


@dataclass(frozen=True)
class JobPlacement:
    """A job and where its pods run."""

    namespace: str
    job: str
    min_nodes: int
    max_nodes: int
    pods: tuple[tuple[str, str], ...]
    """(node, pod) of each member."""
    tls: JobTls | None = None
    """The job's certificate, with authentication on (None: plain HTTP, no identity)."""

    def rdzv_conf(self, timing: Timing) -> dict[str, str]:
        """The agents' whole ``--rdzv-conf``: ``timing``'s, and the job's certificate if it has one."""
        return timing.conf() | (self.tls.rdzv_conf() if self.tls is not None else {})


def identity(namespace: str, node: str, pod: str) -> dict[str, str]:
    """The downward-API environment of a worker pod's agent."""
    return {"NODE_NAME": node, "POD_NAME": pod, "POD_NAMESPACE": namespace}
