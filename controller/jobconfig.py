"""A job's configuration, parsed from its worker pods' annotations (DESIGN contract 1).

Parsing never raises on user input: a bad value becomes a ``ConfigProblem`` naming the
pod, the annotation and the reason, which the controller posts as a Warning Event while
leaving the job alone.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from regroup.controller.cluster import MEMBER_ANNOTATION, PodInfo
from regroup.controller.settings import JobDefaults

PREFIX = "regroup.dev/"
MIN_NODES = PREFIX + "min-nodes"
MAX_NODES = PREFIX + "max-nodes"
RDZV_ENDPOINT = PREFIX + "rdzv-endpoint"
CHECKPOINT_TIMEOUT = PREFIX + "checkpoint-timeout"
JOIN_WINDOW = PREFIX + "join-window"
RESTART_STORM = PREFIX + "restart-storm"
RECLAIM_TAINTS = PREFIX + "reclaim-taints"
SPARE_NODES = PREFIX + "spare-nodes"
MEMBER = MEMBER_ANNOTATION
MEMBER_KINDS = ("node", "pod")
ANNOTATIONS = (
    MIN_NODES, MAX_NODES, RDZV_ENDPOINT, CHECKPOINT_TIMEOUT, JOIN_WINDOW, RESTART_STORM, RECLAIM_TAINTS, SPARE_NODES,
    MEMBER,
)

ROLE_LABEL = "regroup.dev/role"
NAME_LABEL = "app.kubernetes.io/name"


@dataclass(frozen=True)
class JobConfig:
    """A job's validated configuration."""

    min_nodes: int
    max_nodes: int
    rdzv_endpoint: str | None
    checkpoint_timeout: timedelta
    join_window: timedelta
    storm_restarts: int
    storm_window: timedelta
    reclaim_taints: frozenset[str]
    spare_nodes: int = 0
    """Spare nodes the job wants waiting while it trains at max. It sets what the status,
    metrics and alerts compare the spares with, not the policy: a waiting node replaces a
    leaving one whether or not spares were asked for."""
    member: str = "node"
    """What one member of the job is (``regroup.dev/member``): ``node`` or ``pod``."""


@dataclass(frozen=True)
class ConfigProblem:
    """One bad annotation on one pod."""

    pod: PodInfo
    annotation: str
    reason: str
    kind: str = "BadConfig"
    """Event reason: BadConfig, or ConfigDisagreement for pods that differ from the newest."""

    @property
    def message(self) -> str:
        return f"annotation {self.annotation}: {self.reason}"


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``2m``, ``1h30m``, ``500ms`` (a bare number is seconds); raises ValueError."""
    text = text.strip()
    if not text:
        raise ValueError("empty duration")
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return timedelta(seconds=float(text))
    pos, seconds = 0, 0.0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            break
        seconds += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 2m, 1h30m)")
    return timedelta(seconds=seconds)


def is_worker(pod: PodInfo) -> bool:
    """Worker pods run torchrun; the job's etcd (rendezvous) pod, if labelled, is not one."""
    return pod.labels.get(ROLE_LABEL) != "rendezvous" and pod.labels.get(NAME_LABEL) != "etcd"


def config_items(annotations: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The regroup annotations of a pod, in a fixed order (what its config depends on)."""
    return tuple((name, annotations[name]) for name in ANNOTATIONS if name in annotations)


def parse_pod_config(annotations: Mapping[str, str], defaults: JobDefaults) -> JobConfig | list[tuple[str, str]]:
    """The config one pod's annotations describe, or its problems as (annotation, reason)."""
    result = _parse_items(config_items(annotations), defaults)
    return list(result) if isinstance(result, tuple) else result


@functools.lru_cache(maxsize=4096)
def _parse_items(items: tuple[tuple[str, str], ...], defaults: JobDefaults) -> JobConfig | tuple[tuple[str, str], ...]:
    # Pods of a job carry the same annotations: parsing them once per distinct set keeps a
    # decision cheap for jobs of hundreds of pods.
    annotations = dict(items)
    problems: list[tuple[str, str]] = []

    def integer(name: str) -> int | None:
        raw = annotations.get(name)
        if raw is None:
            problems.append((name, "required annotation is missing"))
            return None
        try:
            value = int(raw.strip())
        except ValueError:
            problems.append((name, f"not a whole number: {raw!r}"))
            return None
        if value < 1:
            problems.append((name, f"must be at least 1, got {value}"))
            return None
        return value

    def duration(name: str, default: timedelta) -> timedelta:
        raw = annotations.get(name)
        if raw is None:
            return default
        try:
            value = parse_duration(raw)
        except ValueError as exc:
            problems.append((name, str(exc)))
            return default
        if value <= timedelta(0):
            problems.append((name, f"must be positive, got {raw!r}"))
        return value

    min_nodes, max_nodes = integer(MIN_NODES), integer(MAX_NODES)
    if min_nodes is not None and max_nodes is not None and min_nodes > max_nodes:
        problems.append((MIN_NODES, f"min-nodes {min_nodes} is greater than max-nodes {max_nodes}"))
    checkpoint_timeout = duration(CHECKPOINT_TIMEOUT, defaults.checkpoint_timeout)
    join_window = defaults.join_window
    if JOIN_WINDOW in annotations:
        try:
            join_window = parse_duration(annotations[JOIN_WINDOW])
        except ValueError as exc:
            problems.append((JOIN_WINDOW, str(exc)))
    storm_restarts, storm_window = defaults.storm_restarts, defaults.storm_window
    if RESTART_STORM in annotations:
        raw = annotations[RESTART_STORM]
        count, sep, window = raw.partition("/")
        try:
            if not sep:
                raise ValueError(f"expected K/W such as 3/10m, got {raw!r}")
            storm_restarts = int(count.strip())
            if storm_restarts < 1:
                raise ValueError(f"K must be at least 1, got {storm_restarts}")
            storm_window = parse_duration(window)
            if storm_window <= timedelta(0):
                raise ValueError(f"W must be positive, got {window!r}")
        except ValueError as exc:
            reason = str(exc)
            if reason.startswith("invalid literal"):
                reason = f"K is not a whole number in {raw!r}"
            problems.append((RESTART_STORM, reason))
    endpoint = annotations.get(RDZV_ENDPOINT, defaults.rdzv_endpoint)
    if endpoint is not None:
        for item in endpoint.split(","):
            host, sep, port = item.strip().removeprefix("http://").removeprefix("https://").rpartition(":")
            if not sep or not host or not port.isdigit():
                problems.append((RDZV_ENDPOINT, f"expected host:port[,host:port], got {endpoint!r}"))
                break
    taints = frozenset(t.strip() for t in annotations.get(RECLAIM_TAINTS, "").split(",") if t.strip())
    for taint in taints:
        if not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?", taint):
            problems.append((RECLAIM_TAINTS, f"not a taint key: {taint!r}"))
    spare_nodes = 0
    if SPARE_NODES in annotations:
        raw = annotations[SPARE_NODES]
        try:
            spare_nodes = int(raw.strip())
        except ValueError:
            problems.append((SPARE_NODES, f"not a whole number: {raw!r}"))
        else:
            if spare_nodes < 0:
                problems.append((SPARE_NODES, f"must be at least 0, got {spare_nodes}"))
    member = annotations.get(MEMBER, "node")
    if member not in MEMBER_KINDS:
        problems.append((MEMBER, f"expected node or pod, got {member!r}"))
    if problems:
        return tuple(problems)
    assert min_nodes is not None and max_nodes is not None
    return JobConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        rdzv_endpoint=endpoint,
        checkpoint_timeout=checkpoint_timeout,
        join_window=join_window,
        storm_restarts=storm_restarts,
        storm_window=storm_window,
        reclaim_taints=taints,
        spare_nodes=spare_nodes,
        member=member,
    )


@dataclass(frozen=True)
class ResolvedConfig:
    """A job's config as its pods give it, with every problem found and the pods that matter."""

    config: JobConfig | None
    """None: the job is left alone (no worker pods, or the newest one's annotations are bad)."""
    problems: tuple[ConfigProblem, ...] = ()
    newest: PodInfo | None = None
    """The newest worker pod (its annotations win; job-level Events go on it)."""
    rendezvous_pods: tuple[PodInfo, ...] = ()
    """Pods of the job that run its etcd rather than a worker."""
    workers_by_node: Mapping[str, tuple[PodInfo, ...]] = field(default_factory=dict)
    """Worker pods (including ones being deleted) by the node they run on."""


def update_resolved(resolved: ResolvedConfig | None, old: PodInfo | None, new: PodInfo | None) -> ResolvedConfig | None:
    """``resolved`` after pod ``old`` became ``new`` (``old`` None: added; ``new`` None:
    removed), without a pass over the job's pods, where the change moves nothing but the
    pod itself: both are workers on the same node, neither is the newest (a new pod may
    become it), and both carry the newest pod's annotations (so neither brings or takes a
    problem, nor changes the config).
    None where ``resolve_job_config`` must run again. In a storm most pod changes are
    these, and a pass over a job of hundreds of pods is what a decision cost most."""
    if resolved is None or resolved.config is None or resolved.newest is None:
        return None
    newest = resolved.newest
    for pod in (old, new):
        if pod is not None and (pod.name == newest.name or pod.annotations != newest.annotations or not is_worker(pod)):
            return None
    if new is not None and (new.created_at, new.name) > (newest.created_at, newest.name):
        # A pod created since (a replaced pod is the newest) with the same annotations: it
        # is the newest now, and the config it gives is the same. Problems name the newest
        # pod, so only a job without any keeps them as they are.
        if new.deleting or resolved.problems:
            return None
        newest = new
    if old is not None and new is not None and old.node != new.node:
        return None
    node = new.node if new is not None else old.node if old is not None else None
    if node is None:
        return resolved
    by_node = dict(resolved.workers_by_node)
    group = by_node.get(node, ())
    # In the pods' order, as resolve_job_config groups them: a new pod comes last.
    if old is None:
        group = (*group, new)
    elif new is None:
        group = tuple(p for p in group if p.name != old.name)
    else:
        group = tuple(new if p.name == old.name else p for p in group)
    if group:
        by_node[node] = group  # type: ignore[assignment]
    else:
        by_node.pop(node, None)
    return ResolvedConfig(resolved.config, resolved.problems, newest, resolved.rendezvous_pods, by_node)


def resolve_job_config(pods: Sequence[PodInfo], defaults: JobDefaults) -> ResolvedConfig:
    """The job's config from its newest worker pod, with every problem found on any pod.

    Older pods whose annotations differ from the newest get a ConfigDisagreement problem;
    the newest wins.
    """
    by_node: dict[str, list[PodInfo]] = {}
    rendezvous_pods: list[PodInfo] = []
    live: list[PodInfo] = []
    for p in pods:
        if not is_worker(p):
            rendezvous_pods.append(p)
            continue
        if p.node is not None:
            by_node.setdefault(p.node, []).append(p)
        if not p.deleting:
            live.append(p)
    rendezvous = tuple(rendezvous_pods)
    workers_by_node = {node: tuple(group) for node, group in by_node.items()}
    if not live:
        return ResolvedConfig(None, (), None, rendezvous, workers_by_node)
    problems: list[ConfigProblem] = []
    newest = max(live, key=lambda p: (p.created_at, p.name))
    newest_items = config_items(newest.annotations)
    newest_result = _parse_items(newest_items, defaults)
    for pod in live:
        # Pods of a job nearly always carry equal annotations: compare whole mappings (in C)
        # before extracting and parsing their regroup items.
        if pod is newest or pod.annotations == newest.annotations:
            items, result = newest_items, newest_result
        else:
            items = config_items(pod.annotations)
            result = _parse_items(items, defaults)
        if not isinstance(result, JobConfig):
            problems.extend(ConfigProblem(pod, name, reason) for name, reason in result)
        elif pod is not newest and items != newest_items:
            for name in ANNOTATIONS:
                if pod.annotations.get(name) != newest.annotations.get(name):
                    problems.append(
                        ConfigProblem(
                            pod,
                            name,
                            f"{pod.annotations.get(name)!r} differs from newest pod {newest.name}'s "
                            f"{newest.annotations.get(name)!r}; using the newest",
                            kind="ConfigDisagreement",
                        )
                    )
    config = newest_result
    return ResolvedConfig(
        config if isinstance(config, JobConfig) else None, tuple(problems), newest, rendezvous, workers_by_node
    )
