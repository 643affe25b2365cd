"""The etcd key layout every part of regroup shares (DESIGN contract 3).

This is the one place the layout is written down. All keys of a job live under
``/regroup/jobs/<namespace>/<job>/``::

    members/<node>            MemberRecord, bound to the agent's lease
    rdzv/...                  rendezvous round state (owned by rendezvous/)
    control/controller        ControllerPresence, bound to the controller's lease:
                              while it exists, agents leave joins to the controller
    control/expected          ExpectedMembership for the next round
    control/reform            ReformRequest ("re-form now", with a generation)
    control/checkpoint        CheckpointRequest ("checkpoint now", with a generation)
    control/plan              ReformPlan: the controller's re-form in flight (or the last
                              one, finished), so a new leader continues it; also the
                              job's generation counter
    control/status            JobStatus: the controller's verdict on the job, for
                              ``regroup status``
    control/excluded          Exclusions: nodes under a reclaim notice or cordoned, which
                              no agent may bring back into the job until that lifts
    acks/<generation>/commit  CheckpointAck, written by trainer rank 0 once committed
    progress                  Progress, written by trainer rank 0

The module imports nothing heavy: the controller image has no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "/regroup/jobs"
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class JobKeys:
    """Keys of one job, identified by its namespace and its ``regroup.dev/job`` label."""

    namespace: str
    job: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for field, value in (("namespace", self.namespace), ("job", self.job)):
            if not value or "/" in value:
                raise ValueError(f"JobKeys.{field} must be non-empty and contain no '/': {value!r}")

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.namespace}/{self.job}/"

    # members/
    @property
    def members(self) -> str:
        return self.root + "members/"

    def member(self, node: str) -> str:
        return self.members + node

    # rdzv/
    @property
    def rdzv(self) -> str:
        return self.root + "rdzv/"

    # control/
    @property
    def control(self) -> str:
        return self.root + "control/"

    @property
    def controller(self) -> str:
        return self.control + "controller"

    @property
    def expected(self) -> str:
        return self.control + "expected"

    @property
    def reform(self) -> str:
        return self.control + "reform"

    @property
    def checkpoint(self) -> str:
        return self.control + "checkpoint"

    @property
    def plan(self) -> str:
        return self.control + "plan"

    @property
    def status(self) -> str:
        return self.control + "status"

    @property
    def excluded(self) -> str:
        return self.control + "excluded"

    # acks/
    @property
    def acks(self) -> str:
        return self.root + "acks/"

    def ack(self, generation: int) -> str:
        return f"{self.acks}{generation}/commit"

    # progress
    @property
    def progress(self) -> str:
        return self.root + "progress"

    @classmethod
    def parse(cls, key: str, prefix: str = DEFAULT_PREFIX) -> tuple[JobKeys, str] | None:
        """Split a full key into its job and the part below the job root, or None."""
        head = prefix.rstrip("/") + "/"
        if not key.startswith(head):
            return None
        parts = key[len(head) :].split("/", 2)
        if len(parts) < 3 or not parts[0] or not parts[1]:
            return None
        return cls(parts[0], parts[1], prefix), parts[2]
