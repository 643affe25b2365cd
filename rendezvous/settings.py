"""The knobs of the etcd-v3 rendezvous, parsed once from torchrun's parameters.

``--rdzv-conf`` keys (all optional): ``cacert``, ``cert``, ``key``, ``user``, ``password``,
``lease_ttl``, ``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``excluded_timeout``,
``key_prefix``.
torchrun itself adds ``timeout`` (``--rdzv-timeout``, used when ``join_timeout`` is not
given); any other key is refused with an error naming it, so a typo does not pass silently.
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
from regroup.keys import DEFAULT_NAMESPACE, DEFAULT_PREFIX, JobKeys

CONF_KEYS = (
    "cacert",
    "cert",
    "key",
    "user",
    "password",
    "lease_ttl",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "excluded_timeout",
    "key_prefix",
)
# Keys torchrun adds on its own: ``timeout`` always, ``rank`` for --node-rank.
TORCHRUN_KEYS = ("timeout", "rank", "is_host")


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
    def from_env(cls, env: Mapping[str, str], local_addr: str | None = None, local_world_size: int = 0) -> Identity:
        hostname = socket.gethostname()
        return cls(
            node=env.get("NODE_NAME") or hostname,
            pod=env.get("POD_NAME") or hostname,
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

    def __post_init__(self) -> None:
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
    unknown = sorted(set(conf) - set(CONF_KEYS) - set(TORCHRUN_KEYS))
    if unknown:
        raise SettingsError(f"rdzv-conf: unknown option(s) {', '.join(unknown)}; known: {', '.join(CONF_KEYS)}")
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
    etcd = EtcdSettings(
        endpoints=endpoints, cacert=_path(conf, "cacert"), cert=cert, key=key, user=user, password=password
    )
    identity = Identity.from_env(env, local_addr=local_addr, local_world_size=local_world_size)
    try:
        job = JobKeys(identity.namespace, run_id, str(conf.get("key_prefix") or DEFAULT_PREFIX))
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
    )
