"""The controller's Prometheus metrics (names fixed: dashboards and alerts use them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_REFORM_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class ControllerMetrics:
    """All metrics of one controller, in their own registry (several may share a process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.reform_duration = Histogram(
            "regroup_reform_duration_seconds", "Signal to trainer resumed, per completed re-form; mode: in-place "
            "(the workers outlived it) or restart (they were restarted), unknown if the trainer did not say.",
            ["namespace", "job", "cause", "planned", "mode"], buckets=_REFORM_BUCKETS, registry=r,
        )
        self.phase_duration = Histogram(
            "regroup_reform_phase_duration_seconds", "Duration of one phase of a re-form.",
            ["cause", "phase"], buckets=_PHASE_BUCKETS, registry=r,
        )
        self.reforms = Counter(
            "regroup_reforms", "Re-forms finished.", ["namespace", "job", "cause", "planned"], registry=r
        )
        self.abandoned = Counter(
            "regroup_reforms_abandoned", "Re-forms given up (outcome timeout or superseded); decided afresh.",
            ["namespace", "job", "cause", "phase", "outcome"], registry=r,
        )
        self.job_nodes = Gauge("regroup_job_nodes", "Nodes in the job's current round.", ["namespace", "job"], registry=r)
        self.min_nodes = Gauge("regroup_job_min_nodes", "The job's min-nodes.", ["namespace", "job"], registry=r)
        self.max_nodes = Gauge("regroup_job_max_nodes", "The job's max-nodes.", ["namespace", "job"], registry=r)
        self.stalled = Gauge("regroup_job_stalled", "1 while the job is below its min-nodes.", ["namespace", "job"], registry=r)
        self.spare_nodes = Gauge(
            "regroup_spare_nodes", "Members waiting to join while the job trains at its max-nodes: the next loss or "
            "reclaim is answered with one of them.", ["namespace", "job"], registry=r,
        )
        self.spare_nodes_wanted = Gauge(
            "regroup_spare_nodes_wanted", "The job's regroup.dev/spare-nodes.", ["namespace", "job"], registry=r
        )
        self.replacements = Counter(
            "regroup_node_replacements", "Nodes whose position a waiting node took in completed re-forms, by strategy: "
            "replace (after a loss) or migrate (ahead of a reclaim, handed over at the agreed step).",
            ["namespace", "job", "strategy"], registry=r,
        )
        self.lost_steps = Counter(
            "regroup_lost_steps", "Training steps redone after re-forms.", ["namespace", "job", "cause"], registry=r
        )
        self.cordoned_nodes = Gauge("regroup_cordoned_nodes", "Nodes carrying the restart-storm cordon.", registry=r)
        self.cordons = Counter("regroup_cordons", "Cordons made by the controller.", ["reason"], registry=r)
        self.rounds = Counter(
            "regroup_rendezvous_rounds", "Rendezvous rounds observed.", ["namespace", "job"], registry=r
        )
        self.flapping = Gauge(
            "regroup_rendezvous_flapping", "1 while rounds that gave way before a training step in them come faster "
            "than the threshold.", ["namespace", "job"], registry=r
        )
        self.rendezvous_on_gpu = Gauge(
            "regroup_rendezvous_pod_on_gpu_node", "1 while the job's rendezvous pod runs on a GPU node.",
            ["namespace", "job"], registry=r,
        )
        self.watch_restarts = Counter(
            "regroup_watch_restarts", "Watches restarted (errors, 410 Gone, etcd restarts).", ["source"], registry=r
        )
        self.bad_config = Gauge(
            "regroup_bad_config", "1 while the job's annotations are invalid.", ["namespace", "job"], registry=r
        )
        self.events_dropped = Counter(
            "regroup_events_dropped", "Kubernetes Events not posted (rate-limited, queue-full or error).", ["cause"],
            registry=r,
        )
        self.leader = Gauge("regroup_leader", "1 while this replica leads.", registry=r)
        self.jobs_tracked = Gauge("regroup_jobs_tracked", "Jobs the controller holds in its model.", registry=r)
        self.jobs_removed = Counter(
            "regroup_jobs_removed", "Jobs whose etcd keys the controller removed (finished or gone).", ["reason"],
            registry=r,
        )

    def forget_job(self, namespace: str, job: str) -> None:
        """Drop a removed job's series labelled by namespace and job alone (its gauges and
        rendezvous rounds; the reconciler drops the ones with more labels it made)."""
        for metric in (self.job_nodes, self.min_nodes, self.max_nodes, self.stalled, self.flapping,
                       self.rendezvous_on_gpu, self.bad_config, self.rounds, self.spare_nodes, self.spare_nodes_wanted):
            try:
                metric.remove(namespace, job)
            except KeyError:
                pass
