#!/usr/bin/env python3
"""The Grafana dashboard *regroup: elastic training re-forms*, built with Grafana's SDK.

``grafana-dashboard.json`` beside this file is this script's output and nothing else
(``tests/deploy/test_dashboard.py`` fails when they differ), so the dashboard is changed
here and regenerated:

    python deploy/observability/monitoring/dashboard.py > deploy/observability/monitoring/grafana-dashboard.json

Building it in code keeps ids, grid positions and query refs consistent without hand
counting, and lets the panels share one way of filtering by namespace and job.

Two exporters feed it. regroup's controller (scrape job ``$controller``): its series
carry the training job's ``namespace`` and ``job``, which the ServiceMonitor keeps with
``honorLabels``. etcd (scrape job ``$etcd``) with its standard metrics: the names used
here exist under the same names in etcd 3.4, 3.5 and 3.6.
"""

from __future__ import annotations

import sys
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard

UID = "regroup-overview"
DATASOURCE = dashboard.DataSourceRef(type_val="prometheus", uid="${datasource}")
JOBS = 'namespace=~"$namespace", job=~"$job"'
"""The matchers of every per-job regroup series: the dashboard's namespace and job variables."""
CONTROLLER = 'job=~"$controller"'
ETCD = 'job=~"$etcd"'
"""Scrape jobs. Prometheus may scrape other etcd clusters (the Kubernetes API server's own)."""

Target = tuple[str, str]
"""One query of a panel: PromQL and its legend."""


def _queries(targets: list[Target]) -> list[Dataquery]:
    return [
        Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        for i, (expr, legend) in enumerate(targets)
    ]


def _steps(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return ThresholdsConfig().mode(dashboard.ThresholdsMode.ABSOLUTE).steps(
        [dashboard.Threshold(value=value, color=color) for value, color in steps]
    )


def stat(title: str, description: str, expr: str, *steps: tuple[float | None, str]) -> Stat:
    """One number of the overview row, coloured by ``steps`` (value from which, colour)."""
    return (
        Stat().title(title).description(description).datasource(DATASOURCE)
        .targets(_queries([(expr, "")]))
        .unit("short").thresholds(_steps(*steps))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False).fields(""))
        .height(4).span(3)
    )  # fmt: skip


def timeseries(
    title: str, description: str, unit: str, targets: list[Target], *, width: int = 12, height: int = 8, bars: bool = False
) -> Timeseries:
    """A graph with its legend as a table of last and max values; ``bars`` stacks counts per interval."""
    panel = (
        Timeseries().title(title).description(description).datasource(DATASOURCE)
        .targets(_queries(targets)).unit(unit)
        .legend(common_builders.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM).calcs(["lastNotNull", "max"]))
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.DESCENDING))
        .span(width).height(height)
    )  # fmt: skip
    if bars:
        return (
            panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(20)
            .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL).group("A"))
        )  # fmt: skip
    return panel.draw_style(common.GraphDrawStyle.LINE).fill_opacity(0)


def _second_axis(panel: Timeseries, ref_id: str, unit: str) -> Timeseries:
    """Query ``ref_id`` on a right-hand axis of its own unit (CPU and memory in one panel)."""
    return panel.override_by_query(
        ref_id,
        [dashboard.DynamicConfigValue(id_val="unit", value=unit),
         dashboard.DynamicConfigValue(id_val="custom.axisPlacement", value=common.AxisPlacement.RIGHT)],
    )  # fmt: skip


def _quantiles(series: str, by: str, legend: str, quantiles: tuple[str, ...] = ("0.5", "0.95")) -> list[Target]:
    """``histogram_quantile`` of ``series`` per ``by`` (with ``le``), one target per quantile."""
    return [
        (f"histogram_quantile({q}, sum by (le, {by}) (rate({series}[$__rate_interval])))",
         f"p{round(float(q) * 100)} {legend}")
        for q in quantiles
    ]  # fmt: skip


def _process(title: str, scrape_job: str, what: str, width: int) -> Timeseries:
    """CPU and memory of every process of one scrape job, from the standard ``process_*`` metrics."""
    return _second_axis(
        timeseries(
            title, f"CPU in cores (left) and resident memory (right) of each {what} process, by instance.", "short",
            [(f"sum by (instance) (rate(process_cpu_seconds_total{{{scrape_job}}}[$__rate_interval]))", "CPU {{instance}}"),
             (f"sum by (instance) (process_resident_memory_bytes{{{scrape_job}}})", "memory {{instance}}")],
            width=width,
        ),
        "B", "bytes",
    )  # fmt: skip


class PrometheusAnnotation(dashboard.AnnotationQuery):
    """The SDK's annotation query plus the Prometheus data source's title and text templates,
    which its model lacks (without them a marker says nothing)."""

    def __init__(self, *, title_format: str, text_format: str, **fields: Any) -> None:
        super().__init__(**fields)
        self.title_format = title_format
        self.text_format = text_format

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "titleFormat": self.title_format, "textFormat": self.text_format}


def reform_annotation() -> PrometheusAnnotation:
    """A marker on every graph where a selected job re-formed."""
    return PrometheusAnnotation(
        name="Re-forms", datasource=DATASOURCE, enable=True, icon_color="orange",
        expr=f"changes(regroup_reforms_total{{{JOBS}}}[1m]) > 0",
        title_format="re-form {{cause}}", text_format="{{namespace}}/{{job}}",
    )  # fmt: skip


def variables() -> list[DatasourceVariable | QueryVariable]:
    def by_label(name: str, label: str, query: str, default: str | None = None) -> QueryVariable:
        variable = (
            QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": query, "refId": name}).refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard.VariableSort.ALPHABETICAL_ASC)
        )  # fmt: skip
        if default is None:
            return variable.multi(True).include_all(True).all_value(".*")
        return variable.current(dashboard.VariableOption(selected=True, text=default, value=default))

    return [
        DatasourceVariable("datasource").label("Data source").type("prometheus"),
        by_label("namespace", "Namespace", "label_values(regroup_job_nodes, namespace)"),
        by_label("job", "Job", 'label_values(regroup_job_nodes{namespace=~"$namespace"}, job)'),
        # regroup_leader carries no job label of its own: its job is the controller's scrape
        # job (the ServiceMonitor names it after the Service).
        by_label("controller", "Controller scrape job", "label_values(regroup_leader, job)", "regroup-controller-metrics"),
        by_label("etcd", "etcd scrape job", "label_values(etcd_server_has_leader, job)", "regroup-etcd"),
    ]


def overview() -> list[Stat | Timeseries]:
    return [
        stat("Jobs tracked", "Jobs the leading controller holds state for, all namespaces.",
             "max(regroup_jobs_tracked and on (instance) (regroup_leader == 1))", (None, "blue")),
        stat("Stalled jobs", "Jobs with fewer nodes than regroup.dev/min-nodes: they are not training.",
             f"sum(max by (namespace, job) (regroup_job_stalled{{{JOBS}}})) or vector(0)", (None, "green"), (1, "red")),
        stat("Re-forms (range)", "Re-forms in the selected time range, all causes.",
             f"sum(increase(regroup_reforms_total{{{JOBS}}}[$__range])) or vector(0)", (None, "blue")),
        stat("Lost steps (range)", "Training steps redone after unplanned losses; planned re-forms lose none.",
             f"sum(increase(regroup_lost_steps_total{{{JOBS}}}[$__range])) or vector(0)", (None, "green"), (1, "orange")),
        stat("Abandoned re-forms (range)",
             "Re-forms given up (a phase timed out or a newer signal superseded it) and decided afresh.",
             f"sum(increase(regroup_reforms_abandoned_total{{{JOBS}}}[$__range])) or vector(0)",
             (None, "green"), (1, "orange")),
        stat("Cordoned nodes", "Nodes the controller cordoned for rank restart storms (taint regroup.dev/restart-storm).",
             "max(regroup_cordoned_nodes) or vector(0)", (None, "green"), (1, "orange"), (3, "red")),
        stat("Controller leaders", "Controller replicas that lead: exactly 1, or no job is re-formed.",
             "sum(regroup_leader) or vector(0)", (None, "red"), (1, "green"), (2, "red")),
        stat("etcd has leader", "0 when some etcd member sees no leader: rendezvous writes and lease renewals stall.",
             f"min(etcd_server_has_leader{{{ETCD}}})", (None, "red"), (1, "green")),
    ]  # fmt: skip


def reform_latency() -> list[Stat | Timeseries]:
    duration = f"regroup_reform_duration_seconds_bucket{{{JOBS}}}"
    phase = "regroup_reform_phase_duration_seconds"
    return [
        timeseries(
            "Re-form latency p50 / p95 by cause",
            "From the first signal to the first training step after the re-form. Planned causes (reclaim, grow) "
            "must fit inside the provider's notice window.",
            "s", _quantiles(duration, "cause", "{{cause}}"), width=8, height=9,
        ),
        timeseries(
            "Re-form latency p50 / p95, planned vs unplanned",
            "Planned: the job checkpointed before the re-form (reclaim notice, grow).",
            "s", _quantiles(duration, "planned", "planned={{planned}}"), width=8, height=9,
        ),
        timeseries(
            "Re-form latency p50 / p95, in place vs restart",
            "in-place: the workers outlived the re-form (regroup-run); restart: they were restarted (plain torchrun, "
            "--in-place=off, or a worker that could not re-form in place).",
            "s", _quantiles(duration, "mode", "{{mode}}"), width=8, height=9,
        ),
        timeseries(
            "Phase breakdown (mean seconds per re-form)",
            "detect: signal to decision; checkpoint: request to all acks; rendezvous: new round formed; resume: first "
            "step after it. All jobs (phases carry no job label).",
            "s",
            [(f"sum by (phase) (rate({phase}_sum[$__rate_interval])) / sum by (phase) (rate({phase}_count[$__rate_interval]))",
              "{{phase}}")],
            height=9, bars=True,
        ),
        timeseries("Phase p50 / p95", "Each phase's latency over all causes and jobs.", "s",
                   _quantiles(f"{phase}_bucket", "phase", "{{phase}}"), height=9),
        timeseries("Phase p95 by cause", "Where each cause spends its time; all jobs.", "s",
                   _quantiles(f"{phase}_bucket", "cause, phase", "{{cause}} {{phase}}", ("0.95",)), width=8),
        timeseries("Re-forms by cause", "Finished re-forms per interval, planned or not.", "short",
                   [(f"sum by (cause, planned) (increase(regroup_reforms_total{{{JOBS}}}[$__rate_interval]))",
                     "{{cause}} planned={{planned}}")], width=8, bars=True),
        timeseries("Abandoned re-forms", "Re-forms given up, by the phase they were in and why (timeout or superseded).",
                   "short",
                   [(f"sum by (cause, phase, outcome) (increase(regroup_reforms_abandoned_total{{{JOBS}}}[$__rate_interval]))",
                     "{{cause}} in {{phase}}: {{outcome}}")], width=8, bars=True),
    ]  # fmt: skip


def jobs() -> list[Stat | Timeseries]:
    return [
        timeseries(
            "Nodes per job", "Nodes in the current process group, between the job's min and max lines.", "short",
            [(f"max by (namespace, job) (regroup_job_nodes{{{JOBS}}})", "{{namespace}}/{{job}}"),
             (f"max by (namespace, job) (regroup_job_min_nodes{{{JOBS}}})", "{{namespace}}/{{job}} min"),
             (f"max by (namespace, job) (regroup_job_max_nodes{{{JOBS}}})", "{{namespace}}/{{job}} max")],
            height=9,
        ),
        timeseries(
            "Lost steps by cause", "Training steps redone after a re-form, per interval; planned re-forms lose none.",
            "short",
            [(f"sum by (namespace, job, cause) (increase(regroup_lost_steps_total{{{JOBS}}}[$__rate_interval]))",
              "{{namespace}}/{{job}} {{cause}}")],
            height=9, bars=True,
        ),
        timeseries(
            "Stalled jobs (below min) and bad configuration",
            "1 while a job has fewer nodes than its min-nodes, or while its annotations are invalid (a Warning "
            "Event names the pod and the annotation).",
            "short",
            [(f"max by (namespace, job) (regroup_job_stalled{{{JOBS}}})", "stalled {{namespace}}/{{job}}"),
             (f"max by (namespace, job) (regroup_bad_config{{{JOBS}}})", "bad config {{namespace}}/{{job}}")],
        ),
        timeseries(
            "Rendezvous rounds and flapping",
            "Rounds per interval, and 1 while rounds give way before a training step faster than the flapping threshold.", "short",
            [(f"sum by (namespace, job) (increase(regroup_rendezvous_rounds_total{{{JOBS}}}[$__rate_interval]))",
              "rounds {{namespace}}/{{job}}"),
             (f"max by (namespace, job) (regroup_rendezvous_flapping{{{JOBS}}})", "flapping {{namespace}}/{{job}}")],
        ),
        timeseries(
            "Active and spare nodes per job",
            "Active: nodes training in the current round. Spare: nodes waiting to join while the job trains at its "
            "max, each ready to take a lost or leaving node's place at the same size; wanted: regroup.dev/spare-nodes. "
            "With no spare left, the next loss shrinks the job.",
            "short",
            [(f"max by (namespace, job) (regroup_job_nodes{{{JOBS}}})", "active {{namespace}}/{{job}}"),
             (f"max by (namespace, job) (regroup_spare_nodes{{{JOBS}}})", "spare {{namespace}}/{{job}}"),
             (f"max by (namespace, job) (regroup_spare_nodes_wanted{{{JOBS}}})", "spares wanted {{namespace}}/{{job}}")],
        ),
        timeseries(
            "Node replacements by strategy",
            "Nodes whose position a spare took per interval: replace after a loss, migrate ahead of a reclaim (the "
            "leaving node handed its shards over at the agreed step).",
            "short",
            [(f"sum by (namespace, job, strategy) (increase(regroup_node_replacements_total{{{JOBS}}}[$__rate_interval]))",
              "{{namespace}}/{{job}} {{strategy}}")],
            bars=True,
        ),
    ]  # fmt: skip


def controller() -> list[Stat | Timeseries]:
    return [
        timeseries(
            "Jobs tracked and removed",
            "Jobs the leading controller holds state for, and jobs its clean-up removed per interval, by reason "
            "(finished or gone).",
            "short",
            [("max(regroup_jobs_tracked and on (instance) (regroup_leader == 1))", "tracked"),
             ("sum by (reason) (increase(regroup_jobs_removed_total[$__rate_interval]))", "removed {{reason}}")],
            width=8,
        ),
        timeseries(
            "Cordoned nodes", "Nodes carrying the restart-storm cordon, and new cordons per interval by reason.", "short",
            [("max(regroup_cordoned_nodes)", "cordoned now"),
             ("sum by (reason) (increase(regroup_cordons_total[$__rate_interval]))", "new cordons {{reason}}")],
            width=8,
        ),
        timeseries(
            "Watch restarts", "Kubernetes and etcd watches restarted (errors, 410 Gone, etcd restarts) per interval.",
            "short", [("sum by (source) (increase(regroup_watch_restarts_total[$__rate_interval]))", "{{source}}")],
            width=8,
        ),
        timeseries(
            "Dropped Events", "Kubernetes Events not posted per interval (rate-limited, queue full or an API error).",
            "short", [("sum by (cause) (increase(regroup_events_dropped_total[$__rate_interval]))", "{{cause}}")],
            width=8,
        ),
        timeseries(
            "Leader and rendezvous placement",
            "Controller replicas that lead (exactly 1), and 1 while a job's rendezvous pod runs on a GPU node.",
            "short",
            [("sum(regroup_leader)", "leaders"),
             (f"max by (namespace, job) (regroup_rendezvous_pod_on_gpu_node{{{JOBS}}})",
              "rendezvous pod on GPU node {{namespace}}/{{job}}")],
            width=8,
        ),
        _process("Controller CPU and memory", CONTROLLER, "controller", width=8),
    ]  # fmt: skip


def etcd() -> list[Stat | Timeseries]:
    def bucket(series: str) -> str:
        return f"histogram_quantile(0.99, sum by (le, instance) (rate({series}{{{ETCD}}}[$__rate_interval])))"

    return [
        timeseries(
            "etcd database size vs quota",
            "Writes fail with 'database space exceeded' once the allocated size reaches the quota. Allocated far "
            "above in use: compacted space that a defragmentation would return.",
            "bytes",
            [(f"max by (instance) (etcd_mvcc_db_total_size_in_bytes{{{ETCD}}})", "allocated {{instance}}"),
             (f"max by (instance) (etcd_mvcc_db_total_size_in_use_in_bytes{{{ETCD}}})", "in use {{instance}}"),
             (f"min(etcd_server_quota_backend_bytes{{{ETCD}}})", "quota")],
            width=8,
        ),
        timeseries(
            "etcd leader", "Whether every member sees a leader, and leader elections per interval.", "short",
            [(f"min(etcd_server_has_leader{{{ETCD}}})", "has leader (all members)"),
             (f"max(increase(etcd_server_leader_changes_seen_total{{{ETCD}}}[$__rate_interval]))", "leader changes")],
            width=8,
        ),
        timeseries(
            "etcd disk latency p99",
            "etcd's own guidance: WAL fsync p99 under 10 ms, backend commit p99 under 25 ms. A slower disk delays "
            "every rendezvous write and lease renewal.",
            "s",
            [(bucket("etcd_disk_wal_fsync_duration_seconds_bucket"), "WAL fsync {{instance}}"),
             (bucket("etcd_disk_backend_commit_duration_seconds_bucket"), "backend commit {{instance}}")],
            width=8,
        ),
        timeseries(
            "etcd requests",
            "Puts and deletes as applied (every member applies each one), ranges as served by all members.", "ops",
            [(f"max(rate(etcd_mvcc_put_total{{{ETCD}}}[$__rate_interval]))", "put"),
             (f"max(rate(etcd_mvcc_delete_total{{{ETCD}}}[$__rate_interval]))", "delete"),
             (f"sum(rate(etcd_mvcc_range_total{{{ETCD}}}[$__rate_interval]))", "range")],
            width=6,
        ),
        timeseries(
            "etcd keys and watchers", "Keys in the store, and watchers open on all members (agents and controller).",
            "short",
            [(f"max(etcd_debugging_mvcc_keys_total{{{ETCD}}})", "keys"),
             (f"sum(etcd_debugging_mvcc_watcher_total{{{ETCD}}})", "watchers")],
            width=6,
        ),
        timeseries(
            "etcd leases",
            "Leases granted and revoked per second, and expired: holders that stopped renewing (a member key "
            "of an agent that died goes with its lease).",
            "ops",
            [(f"max(rate(etcd_debugging_lease_granted_total{{{ETCD}}}[$__rate_interval]))", "granted"),
             (f"max(rate(etcd_debugging_lease_revoked_total{{{ETCD}}}[$__rate_interval]))", "revoked"),
             (f"sum(rate(etcd_debugging_server_lease_expired_total{{{ETCD}}}[$__rate_interval]))", "expired")],
            width=6,
        ),
        _process("etcd CPU and memory", ETCD, "etcd member", width=6),
    ]  # fmt: skip


SECTIONS = (
    ("Overview", overview),
    ("Re-form latency", reform_latency),
    ("Jobs", jobs),
    ("Controller and nodes", controller),
    ("etcd", etcd),
)


def build() -> dashboard.Dashboard:
    """The dashboard model: each section an open row with its panels after it, numbered in reading order."""
    builder = (
        Dashboard("regroup: elastic training re-forms").uid(UID)
        .description("Re-form latency by cause and phase, nodes per job, spare nodes, lost steps, cordoned nodes, "
                     "stalled jobs, the controller and etcd.")
        .tags(["regroup", "training"]).timezone("utc").editable().tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
        .refresh("30s").time("now-6h", "now")
        .variables(variables())
    )  # fmt: skip
    for title, panels in SECTIONS:
        builder.with_row(Row(title))
        for panel in panels():
            builder.with_panel(panel)
    model = builder.build()
    model.annotations = dashboard.AnnotationContainer(list_val=[reform_annotation()])
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return model


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build()) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
