"""The knobs of the etcd-v3 rendezvous, parsed once from torchrun's parameters.

Every ``--rdzv-conf`` key that torch's own ``c10d``, ``etcd`` and ``etcd-v2`` backends
accept is accepted here, so an existing launch line works with only the backend changed:
mapped to the equivalent setting where there is one (``ALIASES``, ``protocol``,
``read_timeout``, ``keep_alive_*``), otherwise accepted with one log line saying it has
no effect (``NO_EFFECT``). Our own keys are ``CONF_KEYS``. Values are parsed as torch
parses them (one pair of surrounding quotes is dropped; booleans as ``get_as_bool``).
Only a key no backend knows is refused, naming it, so a typo does not pass silently.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from regroup.etcd import EtcdSettings, parse_endpoints
from regroup.keys import DEFAULT_NAMESPACE, DEFAULT_PREFIX, JobKeys, finished_root

CONF_KEYS = (
    "cacert",
    "cert",
    "key",
    "user",
    "password",
    "protocol",
    "lease_ttl",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "excluded_timeout",
    "read_timeout",
    "key_prefix",
    "node_name",
    "spare_nodes",
)
ALIASES = {
    "ca_cert": "cacert",  # etcd-v2
    "ssl_cert": "cert",  # etcd-v2
    "ssl_cert_key": "key",  # etcd-v2
    "etcd_prefix": "key_prefix",  # etcd
    "ttl": "lease_ttl",
}
"""Other backends' names for our keys."""
KEEP_ALIVE_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")
"""c10d's liveness: a node missing ``max_attempt`` heartbeats ``interval`` s apart is dead.
Without ``lease_ttl``, they set it to ``interval * max_attempt``."""
NO_EFFECT = {
    "heartbeat": "the agent's lease is renewed every lease_ttl/3 instead",
    "is_host": "no agent hosts a store here: each round's store lives in etcd",
    "store_type": "each round's store lives in etcd",
    "use_libuv": "each round's store lives in etcd",
    "local_addr": "torchrun's --local-addr is used",
}
BOOL_KEYS = ("is_host", "use_libuv")
# Keys torchrun adds on its own: ``timeout`` always, ``rank`` for --node-rank.
TORCHRUN_KEYS = ("timeout", "rank")
_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")


class SettingsError(ValueError):
    """A rendezvous option is missing or invalid; the message names it."""


@dataclass(frozen=True)
class Identity:
    """Who this agent is, from the downward-API environment."""

    node: str
    """``NODE_NAME``, else the hostname: the key of this agent's member record."""
    pod: str
    """``POD_NAME``, else the hostname."""
    namespace: str
    """``POD_NAMESPACE``, else ``default``: scopes the job's keys."""
    host: str
    """Address other agents reach this one at (torchrun's ``--local-addr``, else the FQDN)."""
    local_world_size: int = 0
    """Workers this agent runs (0 when not known)."""

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], local_addr: str | None = None, local_world_size: int = 0, node_name: str = ""
    ) -> Identity:
        """``node_name`` (``--rdzv-conf node_name=...``) overrides ``NODE_NAME``; it may say
        ``{hostname}``, ``{pid}`` and ``{pod}`` (``POD_NAME``), so agents sharing a host get
        distinct names: ``{pod}`` in a job whose members are pods (``regroup.dev/member: pod``)."""
        hostname = socket.gethostname()
        # Outside Kubernetes, agents on one host are told apart by their process.
        pod = env.get("POD_NAME") or f"{hostname}:{os.getpid()}"
        node = node_name.format(hostname=hostname, pid=os.getpid(), pod=pod) if node_name else ""
        return cls(
            node=node or env.get("NODE_NAME") or hostname,
            pod=pod,
            namespace=env.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
            host=local_addr or socket.getfqdn(),
            local_world_size=local_world_size,
        )


@dataclass(frozen=True)
class Timeouts:
    """How long each phase may take."""

    join: timedelta = timedelta(seconds=600)
    """Longest ``next_rendezvous`` may wait for a round to form (also bounds the retries
    while etcd is unreachable at start)."""
    last_call: timedelta = timedelta(seconds=5)
    """Once ``min`` nodes have joined the first round (or nodes are still registering),
    how long to wait for more before closing. A re-form of a running job does not wait:
    it closes as soon as every live member has rejoined."""
    close: timedelta = timedelta(seconds=10)
    """Longest ``set_closed``/``shutdown`` wait for etcd to record the change."""
    excluded: timedelta = timedelta(seconds=300)
    """How long an agent whose node is in ``control/excluded`` (reclaim notice, cordon)
    waits for that to lift before it exits non-zero, so its workload's policy applies."""

    def __post_init__(self) -> None:
        for name in ("join", "last_call", "close", "excluded"):
            value = getattr(self, name)
            if value < timedelta(0):
                raise SettingsError(f"{name}_timeout must not be negative, got {value.total_seconds()}s")
        if self.join <= timedelta(0):
            raise SettingsError("join_timeout must be positive")


@dataclass(frozen=True)
class RendezvousSettings:
    """Everything one etcd-v3 rendezvous handler needs, validated at construction."""

    etcd: EtcdSettings
    """Endpoints, TLS and auth."""
    job: JobKeys
    """The job's etcd keys: namespace from ``POD_NAMESPACE``, job from ``--rdzv-id``."""
    identity: Identity
    """This agent."""
    min_nodes: int
    """Smallest round (``--nnodes MIN:MAX``)."""
    max_nodes: int
    """Largest round."""
    lease_ttl: timedelta = timedelta(seconds=5)
    """TTL of the lease behind this agent's member key: a dead agent vanishes within it."""
    timeouts: Timeouts = Timeouts()
    """Join, last-call and close timeouts."""
    notes: tuple[str, ...] = ()
    """What the handler logs once at start: options accepted with no effect, or mapped."""
    spare_nodes: int = 0
    """Spares the job wants: agents beyond ``max_nodes`` waiting to take a leaving node's
    position. Reporting only (a round logs how many there are, and warns when fewer): a
    waiting agent replaces a lost one whether or not spares were asked for."""

    def __post_init__(self) -> None:
        if self.spare_nodes < 0:
            raise SettingsError(f"spare_nodes must not be negative, got {self.spare_nodes}")
        if self.min_nodes < 1:
            raise SettingsError(f"min_nodes must be at least 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise SettingsError(f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})")
        if not timedelta(seconds=2) <= self.lease_ttl <= timedelta(seconds=300):
            raise SettingsError(f"lease_ttl must be between 2s and 300s, got {self.lease_ttl.total_seconds()}s")
        if "/" in self.identity.node or not self.identity.node:
            raise SettingsError(f"node name must be non-empty without '/': {self.identity.node!r}")


def _seconds(conf: Mapping[str, Any], name: str) -> timedelta | None:
    raw = conf.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"rdzv-conf {name}: expected seconds, got {raw!r}") from None
    return timedelta(seconds=value)


def _first(*values: timedelta | None) -> timedelta:
    return next(v for v in values if v is not None)


def _path(conf: Mapping[str, Any], name: str) -> Path | None:
    raw = conf.get(name)
    if not raw:
        return None
    path = Path(str(raw)).expanduser()
    if not path.is_file():
        raise SettingsError(f"rdzv-conf {name}: no such file {path}")
    return path


def _unquote(value: Any) -> Any:
    """One pair of surrounding quotes dropped, as a shell-quoted launch line may leave them."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def normalize_conf(conf: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """torchrun's ``--rdzv-conf`` as our keys, and the notes to log about what was mapped or
    has no effect. Raises ``SettingsError`` naming a key no backend knows, or a bad value."""
    known = set(CONF_KEYS) | set(ALIASES) | set(KEEP_ALIVE_KEYS) | set(NO_EFFECT) | set(TORCHRUN_KEYS)
    unknown = sorted(set(conf) - known)
    if unknown:
        raise SettingsError(
            f"rdzv-conf: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    out: dict[str, Any] = {}
    notes: list[str] = []
    for name, raw in conf.items():
        value = _unquote(raw)
        if name in BOOL_KEYS and value is not None and not isinstance(value, bool):
            if str(value).strip().lower() not in _TRUE + _FALSE:
                raise SettingsError(f"rdzv-conf {name}: expected a boolean (true/false/1/0/yes/no), got {value!r}")
        if name in NO_EFFECT:
            notes.append(f"rdzv-conf {name}={value} has no effect with etcd-v3: {NO_EFFECT[name]}")
        elif name in ALIASES:
            ours = ALIASES[name]
            if ours in conf and _unquote(conf[ours]) != value:
                raise SettingsError(f"rdzv-conf {name} and {ours} name the same setting with different values")
            out[ours] = value
        elif name not in KEEP_ALIVE_KEYS:
            out[name] = value
    if "lease_ttl" not in out and any(k in conf for k in KEEP_ALIVE_KEYS):
        interval, attempts = _number(conf, "keep_alive_interval", 5.0), _number(conf, "keep_alive_max_attempt", 3.0)
        ttl = max(2.0, min(300.0, interval * attempts))
        out["lease_ttl"] = ttl
        notes.append(f"rdzv-conf keep_alive_interval x keep_alive_max_attempt: a dead agent is noticed within "
                     f"lease_ttl={ttl:g}s")
    elif any(k in conf for k in KEEP_ALIVE_KEYS):
        notes.append("rdzv-conf keep_alive_* has no effect: lease_ttl is given")
    return out, notes


def _number(conf: Mapping[str, Any], name: str, default: float) -> float:
    raw = _unquote(conf.get(name, default))
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"rdzv-conf {name}: expected a number, got {raw!r}") from None
    if value <= 0:
        raise SettingsError(f"rdzv-conf {name} must be positive, got {raw!r}")
    return value


def _count(conf: Mapping[str, Any], name: str, default: int) -> int:
    """A whole number >= 0 (``default`` when not given)."""
    raw = conf.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise SettingsError(f"rdzv-conf {name}: expected a whole number >= 0, got {raw!r}") from None
    if value < 0:
        raise SettingsError(f"rdzv-conf {name}: expected a whole number >= 0, got {raw!r}")
    return value


def _https(conf: Mapping[str, Any]) -> bool:
    protocol = str(conf.get("protocol") or "http").strip().lower()
    if protocol not in ("http", "https"):
        raise SettingsError(f"rdzv-conf protocol: expected http or https, got {protocol!r}")
    return protocol == "https"


def parse_settings(
    *,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    conf: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    local_addr: str | None = None,
    local_world_size: int = 0,
) -> RendezvousSettings:
    """Build the settings from torchrun's rendezvous parameters and the environment."""
    env = os.environ if env is None else env
    conf, notes = normalize_conf(conf)
    try:
        endpoints = parse_endpoints(endpoint or "")
    except ValueError as exc:
        raise SettingsError(f"rdzv-endpoint: {exc}") from None
    user, password = conf.get("user") or None, conf.get("password") or None
    if (user is None) != (password is None):
        raise SettingsError("rdzv-conf user and password must be given together")
    cert, key = _path(conf, "cert"), _path(conf, "key")
    if (cert is None) != (key is None):
        raise SettingsError("rdzv-conf cert and key must be given together")
    request = _seconds(conf, "read_timeout")
    if request is not None and request <= timedelta(0):
        raise SettingsError(f"rdzv-conf read_timeout must be positive, got {request.total_seconds()}s")
    etcd = EtcdSettings(
        endpoints=endpoints, cacert=_path(conf, "cacert"), cert=cert, key=key, user=user, password=password,
        https=_https(conf), request_timeout=request or EtcdSettings.request_timeout,
    )  # fmt: skip
    try:
        identity = Identity.from_env(
            env, local_addr=local_addr, local_world_size=local_world_size, node_name=str(conf.get("node_name") or "")
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise SettingsError(f"rdzv-conf node_name: only {{hostname}}, {{pid}} and {{pod}} may be filled in ({exc})") from None
    prefix = str(conf.get("key_prefix") or DEFAULT_PREFIX)
    try:
        finished_root(prefix)
    except ValueError as exc:
        raise SettingsError(f"rdzv-conf key_prefix: {exc}") from None
    try:
        job = JobKeys(identity.namespace, run_id, prefix)
    except ValueError as exc:
        raise SettingsError(f"rdzv-id / POD_NAMESPACE: {exc}") from None
    timeouts = Timeouts(
        join=_first(_seconds(conf, "join_timeout"), _seconds(conf, "timeout"), Timeouts.join),
        last_call=_first(_seconds(conf, "last_call_timeout"), Timeouts.last_call),
        close=_first(_seconds(conf, "close_timeout"), Timeouts.close),
        excluded=_first(_seconds(conf, "excluded_timeout"), Timeouts.excluded),
    )
    return RendezvousSettings(
        etcd=etcd,
        job=job,
        identity=identity,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        lease_ttl=_first(_seconds(conf, "lease_ttl"), RendezvousSettings.lease_ttl),
        timeouts=timeouts,
        notes=tuple(notes),
        spare_nodes=_count(conf, "spare_nodes", RendezvousSettings.spare_nodes),
    )
