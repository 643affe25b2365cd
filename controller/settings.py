"""The controller's knobs: one frozen dataclass tree, durations as ``timedelta``.

Parsed once at the edge (CLI flags, annotations); nothing deeper reads the environment.
Every field is validated at construction with a message that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from regroup.keys import finished_root


def _positive(owner: str, name: str, value: timedelta) -> None:
    if value <= timedelta(0):
        raise ValueError(f"{owner}.{name} must be positive, got {value}")


@dataclass(frozen=True)
class JobDefaults:
    """What a job gets when its pods leave an optional annotation out (contract 1)."""

    checkpoint_timeout: timedelta = timedelta(seconds=120)
    """How long a planned resize waits for the checkpoint ack."""
    join_window: timedelta = timedelta(seconds=10)
    """How long joining nodes are gathered into one grow."""
    storm_restarts: int = 3
    """K of the restart-storm rule: K rank restarts within ``storm_window`` on one node."""
    storm_window: timedelta = timedelta(minutes=10)
    """W of the restart-storm rule."""
    rdzv_endpoint: str | None = None
    """etcd endpoint for jobs that name none (the controller's own etcd when None)."""

    def __post_init__(self) -> None:
        _positive("JobDefaults", "checkpoint_timeout", self.checkpoint_timeout)
        if self.join_window < timedelta(0):
            raise ValueError(f"JobDefaults.join_window must not be negative, got {self.join_window}")
        if self.storm_restarts < 1:
            raise ValueError(f"JobDefaults.storm_restarts must be at least 1, got {self.storm_restarts}")
        _positive("JobDefaults", "storm_window", self.storm_window)


@dataclass(frozen=True)
class ReformSettings:
    """How re-forms are driven and given up on."""

    notice_margin: timedelta = timedelta(seconds=5)
    """Kept free at the end of a reclaim notice for the re-form itself: the checkpoint
    wait ends this long before the node is due to vanish (half of the notice, for a notice
    shorter than twice this: a 5 s grace keeps 2.5 s for the checkpoint, 2.5 s for the re-form)."""
    min_planned_grace: timedelta = timedelta(seconds=2)
    """A member whose pod is being deleted, or whose agent is leaving, with less than this
    left of its grace is a loss (unplanned re-form at once), not a notice: too little time
    to hand its state over. Also when its grace has run out."""
    rendezvous_timeout: timedelta = timedelta(minutes=5)
    """A re-form whose expected members have not all joined the new round by then is
    given up (outcome ``timeout``) and decided afresh."""
    resume_timeout: timedelta = timedelta(minutes=10)
    """A re-form whose trainer has not reported progress at the new size by then is
    finished with outcome ``timeout``."""
    flapping_rounds: int = 4
    """Rendezvous rounds that gave way to the next before the trainers took a step in them,
    within ``flapping_window``, that raise the flapping alert."""
    flapping_window: timedelta = timedelta(minutes=10)
    """Window of the flapping alert."""

    def __post_init__(self) -> None:
        if self.notice_margin < timedelta(0):
            raise ValueError(f"ReformSettings.notice_margin must not be negative, got {self.notice_margin}")
        if self.min_planned_grace < timedelta(0):
            raise ValueError(f"ReformSettings.min_planned_grace must not be negative, got {self.min_planned_grace}")
        _positive("ReformSettings", "rendezvous_timeout", self.rendezvous_timeout)
        _positive("ReformSettings", "resume_timeout", self.resume_timeout)
        if self.flapping_rounds < 2:
            raise ValueError(f"ReformSettings.flapping_rounds must be at least 2, got {self.flapping_rounds}")
        _positive("ReformSettings", "flapping_window", self.flapping_window)


@dataclass(frozen=True)
class CordonSettings:
    """The restart-storm cordon budget: a bad image must not cordon the fleet."""

    budget_fraction: float = 0.10
    """Most nodes (as a fraction of the nodes hosting regroup pods) cordoned at once."""
    budget_min: int = 1
    """The budget is never below this many nodes."""
    taint_key: str = "regroup.dev/restart-storm"
    """Taint (``NoSchedule``) put on a cordoned node; also how cordons are counted."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget_fraction <= 1.0:
            raise ValueError(f"CordonSettings.budget_fraction must be within [0, 1], got {self.budget_fraction}")
        if self.budget_min < 0:
            raise ValueError(f"CordonSettings.budget_min must not be negative, got {self.budget_min}")
        if not self.taint_key:
            raise ValueError("CordonSettings.taint_key must not be empty")

    def budget(self, hosting_nodes: int) -> int:
        """How many nodes may carry the restart-storm cordon at once."""
        return max(self.budget_min, int(hosting_nodes * self.budget_fraction))


@dataclass(frozen=True)
class CleanupSettings:
    """What the controller removes from etcd once a job is over."""

    retention: timedelta = timedelta(minutes=10)
    """How long a job that is over keeps what it left in etcd: a finished job its keys
    (``regroup status`` still shows its verdict and last re-form meanwhile), a job whose pods
    and members are all gone its keys, a removed finished job its tombstone once its pods are
    gone. Ten minutes outlasts a controller failover (a 15 s Lease) and the agents' lease TTL,
    so nothing still at work meets a removal, yet a fleet running short jobs all day holds
    only the last ten minutes' worth of them. Counted from moments kept in etcd (the status
    record, the tombstone), so a new leader does not start the wait again."""

    def __post_init__(self) -> None:
        _positive("CleanupSettings", "retention", self.retention)


@dataclass(frozen=True)
class RuntimeSettings:
    """The controller process: work queue, etcd, presence."""

    workers: int = 4
    """Jobs reconciled concurrently (one worker per job key at a time)."""
    lease_ttl: timedelta = timedelta(seconds=10)
    """TTL of the controller's etcd lease (its presence keys vanish this long after it dies)."""
    etcd_retry: timedelta = timedelta(seconds=1)
    """First back-off after an etcd watch or write fails; doubles up to ``etcd_retry_max``."""
    etcd_retry_max: timedelta = timedelta(seconds=15)
    """Longest back-off between etcd retries."""
    resync: timedelta = timedelta(seconds=60)
    """Every job is reconciled at least this often, events or not."""
    identity: str = "regroup-controller"
    """Written into each job's ``control/controller`` presence record."""
    http_port: int | None = None
    """Serve ``/metrics``, ``/healthz``, ``/readyz`` on this port (None: no HTTP server)."""
    http_host: str = "0.0.0.0"
    """Address the HTTP server binds (``--listen-address``): every IPv4 address of the host by
    default; the pod IP or 127.0.0.1 keeps it off other interfaces."""
    etcd_job_identities: bool = False
    """Give every job its own etcd user and role (``regroup.etcd.auth``), made as soon as the
    job is seen and removed once nothing of it is left (``--etcd-job-identities``). The
    controller's own etcd identity must then hold etcd's ``root`` role: etcd has no narrower
    permission for managing users and roles."""
    etcd_identity_grace: timedelta = timedelta(seconds=30)
    """How long a job has been gone (no pods, keys or tombstone) before its etcd identity is
    removed: a removal is never urgent, and a job seen gone for a moment (its keys deleted in
    the same step as its tombstone was written, a pod replaced) keeps it instead of having it
    removed and made again, each change of etcd's users and roles making every job's
    in-flight requests try again."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"RuntimeSettings.workers must be at least 1, got {self.workers}")
        if self.lease_ttl < timedelta(seconds=2):
            raise ValueError(f"RuntimeSettings.lease_ttl must be at least 2s, got {self.lease_ttl}")
        _positive("RuntimeSettings", "etcd_retry", self.etcd_retry)
        _positive("RuntimeSettings", "etcd_retry_max", self.etcd_retry_max)
        _positive("RuntimeSettings", "resync", self.resync)
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"RuntimeSettings.http_port must be a port number, got {self.http_port}")


@dataclass(frozen=True)
class KubeSettings:
    """The Kubernetes adapter: list+watch, back-off, leader election."""

    page_size: int = 500
    """Objects per page when listing."""
    watch_timeout: timedelta = timedelta(minutes=5)
    """A watch is ended by the server after this long and resumed from its last version."""
    resync: timedelta = timedelta(minutes=10)
    """Nodes and pods are listed again in full this often, watches or not."""
    backoff: timedelta = timedelta(milliseconds=200)
    """First wait after a failed list or watch; doubles up to ``backoff_max``."""
    backoff_max: timedelta = timedelta(seconds=30)
    """Longest wait between failed lists or watches."""
    lease_duration: timedelta = timedelta(seconds=15)
    """Leader election: how long a leader's Lease stays valid without renewal."""
    renew_deadline: timedelta = timedelta(seconds=10)
    """Leader election: a leader that cannot renew for this long steps down."""
    retry_period: timedelta = timedelta(seconds=2)
    """Leader election: how often to try to acquire or renew the Lease."""
    event_component: str = "regroup-controller"
    """``source.component`` / ``reportingComponent`` of the Events the controller posts."""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"KubeSettings.page_size must be at least 1, got {self.page_size}")
        for name in ("watch_timeout", "resync", "backoff", "backoff_max", "lease_duration", "renew_deadline", "retry_period"):
            _positive("KubeSettings", name, getattr(self, name))
        if not self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "KubeSettings: retry_period < renew_deadline < lease_duration must hold, got "
                f"{self.retry_period}, {self.renew_deadline}, {self.lease_duration}"
            )


@dataclass(frozen=True)
class ControllerSettings:
    """All knobs of the controller, grouped by concern."""

    jobs: JobDefaults = field(default_factory=JobDefaults)
    """Defaults for annotations a job leaves out."""
    reform: ReformSettings = field(default_factory=ReformSettings)
    """Re-form timeouts and the flapping alert."""
    cordon: CordonSettings = field(default_factory=CordonSettings)
    """Restart-storm cordons."""
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    """The process: workers, etcd lease, resync, HTTP."""
    kube: KubeSettings = field(default_factory=KubeSettings)
    """The Kubernetes adapter (unused by other cluster adapters)."""
    cleanup: CleanupSettings = field(default_factory=CleanupSettings)
    """Removing the keys of jobs that are over."""
    etcd_prefix: str = "/regroup/jobs"
    """Root of every job's keys (``regroup.keys``); finished jobs' tombstones go beside it
    (``regroup.keys.finished_root``)."""

    def __post_init__(self) -> None:
        if not self.etcd_prefix.startswith("/"):
            raise ValueError(f"ControllerSettings.etcd_prefix must start with '/', got {self.etcd_prefix!r}")
        try:
            finished_root(self.etcd_prefix)
        except ValueError as exc:
            raise ValueError(f"ControllerSettings.etcd_prefix: {exc}") from None
