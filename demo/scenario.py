"""Demo scenarios: a small cluster, a job's size limits, and a script of churn.

A scenario is a YAML file (see ``scenarios/default.yaml``). It is parsed once, here,
into frozen dataclasses; a bad file raises ``ScenarioError`` naming the field, e.g.
``events[1].notice: expected a duration like 30s, got 'soon'``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import yaml

SCENARIOS_DIR = Path(__file__).parent / "scenarios"
DEFAULT_RECLAIM_TAINT = "aws-node-termination-handler/spot-itn"
SPARE_NODES_ANNOTATION = "regroup.dev/spare-nodes"
"""How many warm spares the job wants (the controller's reporting and alerts)."""

Action = Literal["reclaim", "evict", "drain", "uncordon", "lose", "vanish", "restore", "flaky"]
ACTIONS: tuple[str, ...] = ("reclaim", "evict", "drain", "uncordon", "lose", "vanish", "restore", "flaky")


class ScenarioError(ValueError):
    """A scenario file or override is invalid; the message names the field."""


@dataclass(frozen=True)
class ChurnEvent:
    """One scripted thing that happens to the cluster."""

    at: timedelta
    """When, on the scenario's clock: from the moment the job first trains settled (every
    node it starts with in its world, its spares waiting). An event also waits (up to three
    minutes) for the previous one's re-form to finish, so each event's cost is measured on
    its own; that wait pushes the events after it back by as much."""
    action: Action
    """``reclaim``: a reclaim taint with a notice, then the node is killed; ``evict``: the
    node's pod is evicted as the Eviction API does it (``DisruptionTarget=True`` and the
    deletion with the notice as its grace period; SIGTERM to its agent,
    SIGKILL at the grace's end), and its workload starts a new pod on the node;
    ``drain``: ``kubectl drain``: the node is cordoned, then its pod evicted the same way
    (no new pod starts there while it is cordoned); ``uncordon``: the node takes pods
    again and its workload's pending pod starts there; ``lose``: the
    node and everything on it is SIGKILLed, and the node and its pod vanish from the API;
    ``vanish``: everything on the node is SIGKILLed and nothing is written to the API (the
    node still reads Ready and its pod Running, as a dead node's do until the node controller
    notices, 40 s later): only the job's own peers can tell; ``restore``: lost nodes come back
    with a new agent; ``flaky``: the node's rank starts crashing every ``crash_after_steps`` steps."""
    nodes: tuple[str, ...]
    """The nodes it happens to."""
    notice: timedelta = timedelta(0)
    """``reclaim``: how long between the notice and the node's death; ``evict`` and
    ``drain``: the eviction's grace period (SIGTERM, then SIGKILL once it is over)."""
    taint: str = DEFAULT_RECLAIM_TAINT
    """``reclaim`` only: the taint key the reclaim notice carries."""
    crash_after_steps: int = 0
    """``flaky`` only: the node's rank is killed this many steps into each incarnation;
    0: as soon as it starts (a node that cannot run its rank at all, e.g. a bad GPU)."""

    def describe(self) -> str:
        who = ", ".join(self.nodes)
        if self.action == "reclaim":
            return f"reclaim notice on {who} ({self.notice.total_seconds():.0f}s, {self.taint})"
        if self.action == "evict":
            return f"eviction of {who}'s pod (DisruptionTarget, {self.notice.total_seconds():.0f}s grace)"
        if self.action == "drain":
            return f"drain of {who} (cordon, then eviction with {self.notice.total_seconds():.0f}s grace)"
        if self.action == "uncordon":
            return f"{who} uncordoned"
        if self.action == "lose":
            return f"abrupt loss of {who}"
        if self.action == "vanish":
            return f"silent death of {who} (SIGKILL, nothing written to the API)"
        if self.action == "restore":
            return f"{who} come{'s' if len(self.nodes) == 1 else ''} back"
        if self.crash_after_steps == 0:
            return f"{who} starts crashing its rank at every start"
        return f"{who} starts crashing its rank every {self.crash_after_steps} steps"


@dataclass(frozen=True)
class JobSpec:
    """The training job, as its worker pods' annotations describe it (DESIGN contract 1)."""

    name: str = "demo"
    """The ``regroup.dev/job`` label, torchrun's ``--rdzv-id``."""
    min_nodes: int = 2
    """Smallest world the job trains at, in nodes."""
    max_nodes: int = 4
    """Largest world, in nodes."""
    nproc_per_node: int = 1
    """Ranks per node (torchrun ``--nproc-per-node``)."""
    max_restarts: int = 100
    """torchrun ``--max-restarts`` of each agent."""
    checkpoint_timeout: str = "20s"
    """``regroup.dev/checkpoint-timeout``."""
    join_window: str = "5s"
    """``regroup.dev/join-window``."""
    restart_storm: str = "3/2m"
    """``regroup.dev/restart-storm``."""
    spare_nodes: int = 0
    """``regroup.dev/spare-nodes`` (and the agents' ``--rdzv-conf spare_nodes``): how many
    warm spares the job wants waiting beyond ``max_nodes``. It sets what is reported and
    alerted on, not the policy: a waiting node replaces a leaving one whatever it says."""

    def annotations(self) -> dict[str, str]:
        return {
            "regroup.dev/min-nodes": str(self.min_nodes),
            "regroup.dev/max-nodes": str(self.max_nodes),
            "regroup.dev/checkpoint-timeout": self.checkpoint_timeout,
            "regroup.dev/join-window": self.join_window,
            "regroup.dev/restart-storm": self.restart_storm,
            SPARE_NODES_ANNOTATION: str(self.spare_nodes),
        }


@dataclass(frozen=True)
class Scenario:
    """A whole demo run."""

    name: str
    nodes: tuple[str, ...]
    """The local nodes, each running one torchrun agent. The first ``job.max_nodes`` start
    together and form the job; the others start once it trains and wait as its spares, so
    the nodes the script names are the ones training."""
    duration: timedelta
    """How long the scenario plays, on its clock (``ChurnEvent.at``): from the moment the job
    first trains settled, plus any time the events waited for the job to settle."""
    job: JobSpec
    events: tuple[ChurnEvent, ...]
    """Sorted by ``at``."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Passed to the trainer's YAML config (merged over the demo's defaults)."""

    def next_event(self, elapsed: timedelta) -> ChurnEvent | None:
        return next((e for e in self.events if e.at > elapsed), None)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any, where: str) -> timedelta:
    """``30s``, ``2m``, ``1.5h``, ``500ms`` or a number of seconds."""
    if isinstance(value, bool):
        raise ScenarioError(f"{where}: expected a duration like 30s, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ScenarioError(f"{where}: expected a duration like 30s, got {value!r}")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds < 0:
        raise ScenarioError(f"{where}: must not be negative, got {value!r}")
    return timedelta(seconds=seconds)


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    if value < minimum:
        raise ScenarioError(f"{where}: must be at least {minimum}, got {value}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ScenarioError(f"{where}: expected a non-empty string, got {value!r}")
    return value.strip()


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(body: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ScenarioError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(sorted(allowed))})")


def _node_names(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        count = _int(value, where, 1)
        return tuple(f"node-{i}" for i in range(1, count + 1))
    if isinstance(value, list) and value:
        names = tuple(_str(v, f"{where}[{i}]") for i, v in enumerate(value))
        for i, name in enumerate(names):
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
                raise ScenarioError(f"{where}[{i}]: {name!r} is not a valid node name (lowercase, digits, '-')")
        if len(set(names)) != len(names):
            raise ScenarioError(f"{where}: node names must be unique")
        return names
    raise ScenarioError(f"{where}: expected a node count or a list of node names, got {value!r}")


def _parse_job(body: dict[str, Any]) -> JobSpec:
    _check_keys(body, {f for f in JobSpec.__dataclass_fields__}, "job")
    defaults = JobSpec()
    job = JobSpec(
        name=_str(body.get("name", defaults.name), "job.name"),
        min_nodes=_int(body.get("min_nodes", defaults.min_nodes), "job.min_nodes", 1),
        max_nodes=_int(body.get("max_nodes", defaults.max_nodes), "job.max_nodes", 1),
        nproc_per_node=_int(body.get("nproc_per_node", defaults.nproc_per_node), "job.nproc_per_node", 1),
        max_restarts=_int(body.get("max_restarts", defaults.max_restarts), "job.max_restarts", 0),
        checkpoint_timeout=_str(str(body.get("checkpoint_timeout", defaults.checkpoint_timeout)), "job.checkpoint_timeout"),
        join_window=_str(str(body.get("join_window", defaults.join_window)), "job.join_window"),
        restart_storm=_str(str(body.get("restart_storm", defaults.restart_storm)), "job.restart_storm"),
        spare_nodes=_int(body.get("spare_nodes", defaults.spare_nodes), "job.spare_nodes", 0),
    )
    parse_duration(job.checkpoint_timeout, "job.checkpoint_timeout")
    parse_duration(job.join_window, "job.join_window")
    if not re.fullmatch(r"\d+/\d+(\.\d+)?(ms|s|m|h)?", job.restart_storm):
        raise ScenarioError(f"job.restart_storm: expected K/W like 3/2m, got {job.restart_storm!r}")
    if job.min_nodes > job.max_nodes:
        raise ScenarioError(f"job.min_nodes: {job.min_nodes} is larger than job.max_nodes ({job.max_nodes})")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job.name):
        raise ScenarioError(f"job.name: {job.name!r} is not a valid job name (lowercase, digits, '-')")
    return job


def _parse_event(body: Any, where: str, known_nodes: tuple[str, ...]) -> ChurnEvent:
    body = _mapping(body, where)
    action = body.get("action")
    if action not in ACTIONS:
        raise ScenarioError(f"{where}.action: expected one of {', '.join(ACTIONS)}, got {action!r}")
    allowed = {"at", "action", "node", "nodes"}
    extra = {"reclaim": {"notice", "taint"}, "evict": {"notice"}, "drain": {"notice"}, "flaky": {"crash_after_steps"}}
    allowed |= extra.get(action, set())
    _check_keys(body, allowed, where)
    if "at" not in body:
        raise ScenarioError(f"{where}.at: required")
    at = parse_duration(body["at"], f"{where}.at")
    if ("node" in body) == ("nodes" in body):
        raise ScenarioError(f"{where}.node: give exactly one of 'node' or 'nodes'")
    if "node" in body:
        nodes = (_str(body["node"], f"{where}.node"),)
        node_field = f"{where}.node"
    else:
        raw = body["nodes"]
        if not isinstance(raw, list) or not raw:
            raise ScenarioError(f"{where}.nodes: expected a non-empty list of node names, got {raw!r}")
        nodes = tuple(_str(v, f"{where}.nodes[{i}]") for i, v in enumerate(raw))
        node_field = f"{where}.nodes"
    for name in nodes:
        if name not in known_nodes:
            raise ScenarioError(f"{node_field}: unknown node {name!r} (nodes: {', '.join(known_nodes)})")
    event = ChurnEvent(at=at, action=action, nodes=nodes)
    if action == "reclaim":
        if "notice" not in body:
            raise ScenarioError(f"{where}.notice: required for a reclaim")
        event = replace(
            event,
            notice=parse_duration(body["notice"], f"{where}.notice"),
            taint=_str(body.get("taint", DEFAULT_RECLAIM_TAINT), f"{where}.taint"),
        )
    if action in ("evict", "drain"):
        if "notice" not in body:
            what = "an eviction" if action == "evict" else "a drain"
            raise ScenarioError(f"{where}.notice: required for {what} (the pod's grace period)")
        event = replace(event, notice=parse_duration(body["notice"], f"{where}.notice"))
    if action == "flaky":
        if "crash_after_steps" not in body:
            raise ScenarioError(f"{where}.crash_after_steps: required for a flaky node")
        event = replace(event, crash_after_steps=_int(body["crash_after_steps"], f"{where}.crash_after_steps", 0))
    return event


def parse_scenario(body: Any, name: str = "scenario") -> Scenario:
    """Build a Scenario from parsed YAML; raises ScenarioError naming the bad field."""
    body = _mapping(body, name) if body is not None else {}
    _check_keys(body, {"name", "nodes", "duration", "job", "events", "trainer"}, "")
    if "nodes" not in body:
        raise ScenarioError("nodes: required (a count or a list of names)")
    nodes = _node_names(body["nodes"], "nodes")
    if "duration" not in body:
        raise ScenarioError("duration: required")
    duration = parse_duration(body["duration"], "duration")
    if duration <= timedelta(0):
        raise ScenarioError("duration: must be positive")
    job = _parse_job(_mapping(body.get("job", {}), "job"))
    raw_events = body.get("events", [])
    if not isinstance(raw_events, list):
        raise ScenarioError(f"events: expected a list, got {type(raw_events).__name__}")
    events = tuple(
        sorted((_parse_event(e, f"events[{i}]", nodes) for i, e in enumerate(raw_events)), key=lambda e: e.at)
    )
    trainer = _mapping(body.get("trainer", {}) or {}, "trainer")
    return Scenario(
        name=_str(body.get("name", name), "name"),
        nodes=nodes,
        duration=duration,
        job=job,
        events=events,
        trainer=dict(trainer),
    )


def resolve_scenario_path(value: str) -> Path:
    """A file path, or the name of a bundled scenario (``default``, ``short``)."""
    path = Path(value)
    if path.is_file():
        return path
    bundled = SCENARIOS_DIR / f"{value}.yaml"
    if bundled.is_file():
        return bundled
    names = ", ".join(sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml")))
    raise ScenarioError(f"--scenario: no file {value!r} and no bundled scenario of that name ({names})")


def load_scenario(path: Path) -> Scenario:
    try:
        body = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return parse_scenario(body, name=path.stem)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None


def with_overrides(scenario: Scenario, *, nodes: int | None = None, duration: str | None = None) -> Scenario:
    """Apply command-line overrides, validating them as the file's own fields would be.
    With ``nodes``, the job's max follows: every node but the spares it wants."""
    if nodes is not None:
        names = _node_names(nodes, "--nodes")
        for i, event in enumerate(scenario.events):
            missing = [n for n in event.nodes if n not in names]
            if missing:
                raise ScenarioError(
                    f"--nodes: events[{i}] names {missing[0]!r}, which {nodes} nodes do not include"
                )
        job = scenario.job
        if job.min_nodes + job.spare_nodes > len(names):
            spares = f" and job.spare_nodes ({job.spare_nodes})" if job.spare_nodes else ""
            raise ScenarioError(f"--nodes: {nodes} is fewer than job.min_nodes ({job.min_nodes}){spares}")
        # The job may use every node it is given, but for the spares it wants.
        scenario = replace(scenario, nodes=names, job=replace(job, max_nodes=len(names) - job.spare_nodes))
    if duration is not None:
        span = parse_duration(duration, "--duration")
        if span <= timedelta(0):
            raise ScenarioError("--duration: must be positive")
        scenario = replace(scenario, duration=span)
    return scenario


def with_spares(scenario: Scenario, count: int) -> Scenario:
    """``scenario`` with ``count`` more nodes, which the job keeps as warm spares
    (``job.spare_nodes``); its max, and so the nodes that train, stay as they were. The new
    nodes are named on from the last ``node-N`` (``node-5`` after four)."""
    if count < 0:
        raise ScenarioError(f"spares: must not be negative, got {count}")
    taken = set(scenario.nodes)
    numbers = (int(n.removeprefix("node-")) for n in taken if re.fullmatch(r"node-\d+", n))
    start = max(numbers, default=0) + 1
    added = tuple(f"node-{i}" for i in range(start, start + count))
    return replace(
        scenario,
        nodes=scenario.nodes + added,
        job=replace(scenario.job, spare_nodes=scenario.job.spare_nodes + count),
    )
