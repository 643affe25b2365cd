"""What the benchmark reads: etcd's ``/metrics`` and its JSON gateway, and ``/proc`` of a pid.

etcd serves ``/metrics`` and the gRPC gateway (``/v3/...``) on its client URL, so the
lease list, key counts, compaction and defragmentation need no client of their own.

With authentication on (``GatewayAccess``) the gateway is reached over HTTPS with a client
certificate and a token: under ``--client-cert-auth`` etcd 3.4's gateway refuses a
certificate that has a CN (it cannot pass the CN on), so the benchmark presents one without
and logs in as a password user (``etcd_auth``); the token is renewed when etcd says it
expired (a simple token lives 5 minutes past its last use).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = (
    "etcd_mvcc_put_total",
    "etcd_mvcc_delete_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_debugging_mvcc_events_total",
    "etcd_debugging_lease_granted_total",
    "etcd_debugging_lease_revoked_total",
    "etcd_debugging_lease_renewed_total",
    "etcd_debugging_server_lease_expired_total",
    "etcd_debugging_mvcc_total_put_size_in_bytes",
)
"""Counters whose rate over the measurement window is reported."""
GAUGES = (
    "etcd_debugging_mvcc_watcher_total",
    "etcd_debugging_mvcc_watch_stream_total",
    "etcd_debugging_mvcc_slow_watcher_total",
    "etcd_debugging_mvcc_keys_total",
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
)
"""Gauges reported as read at the window's end."""
GRPC_STARTED = "grpc_server_started_total"
"""gRPC calls and streams started, by service and method."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


@dataclass(frozen=True)
class GatewayAccess:
    """How the benchmark reaches a TLS etcd with authentication on through its gateway."""

    cacert: Path
    cert: Path
    """A client certificate without a CN (the gateway refuses one with a CN)."""
    key: Path
    user: str
    """A password user of role ``root`` (compaction, defragmentation and the user and role
    lists need it)."""
    password: str

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.cacert))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


@dataclass
class EtcdGateway:
    """etcd's client URL (``http://host:port``, or ``https://`` with ``access``)."""

    url: str
    access: GatewayAccess | None = None
    _context: ssl.SSLContext | None = field(default=None, init=False, repr=False)
    _token: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.access is not None:
            self._context = self.access.context()

    def _open(self, request: urllib.request.Request | str, timeout: float) -> bytes:
        with urllib.request.urlopen(request, timeout=timeout, context=self._context) as response:
            return bytes(response.read())

    def _send(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        headers = {"Authorization": self._token} if self._token else {}
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST", headers=headers)
        return dict(json.loads(self._open(request, timeout) or b"{}"))

    def _post(self, path: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        try:
            return self._send(path, body, timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != 401 or self._token is None:
                raise
        self.login()  # etcd says the token expired: a fresh one, and once more
        return self._send(path, body, timeout)

    def login(self) -> None:
        """A token for ``access``' user (authentication must be on); every request presents it."""
        assert self.access is not None, "login: a gateway without access has no user"
        self._token = None
        answer = self._post("/v3/auth/authenticate", {"name": self.access.user, "password": self.access.password})
        self._token = str(answer["token"])

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Until the gateway answers (a TLS etcd's start waits only for its port to accept)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._post("/v3/maintenance/status", {}, timeout=2.0)
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def add_root_user(self, name: str, password: str) -> None:
        """On a fresh etcd whose authentication is still off: the role ``root`` and a
        password user ``name`` holding it (the gateway can log in no other way)."""
        self._post("/v3/auth/role/add", {"name": "root"})
        self._post("/v3/auth/user/add", {"name": name, "password": password})
        self._post("/v3/auth/user/grant", {"user": name, "role": "root"})

    def metrics(self) -> dict[str, float]:
        """Every sample of ``COUNTERS`` and ``GAUGES`` (summed over labels), and the gRPC calls
        and streams started by method as ``grpc:<method>`` (a lease keep-alive is a stream)."""
        text = self._open(f"{self.url}/metrics", 10).decode()
        wanted = set(COUNTERS) | set(GAUGES)
        out = dict.fromkeys(wanted, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    out[sample.name] += sample.value
                elif sample.name == GRPC_STARTED:
                    key = f"grpc:{sample.labels.get('grpc_method', '?')}"
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def leases(self) -> int:
        return len(self._post("/v3/lease/leases", {}).get("leases", []))

    def count(self, prefix: str) -> int:
        """Keys under ``prefix``."""
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True}
        return int(self._post("/v3/kv/range", body).get("count", 0))

    def keys(self, prefix: str, limit: int = 20) -> list[str]:
        """The first ``limit`` keys under ``prefix``."""
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "keys_only": True, "limit": limit}
        return [base64.b64decode(kv["key"]).decode() for kv in self._post("/v3/kv/range", body).get("kvs", [])]

    def users(self) -> list[str]:
        """etcd's users (the Auth API; needs ``root``)."""
        return [str(u) for u in self._post("/v3/auth/user/list", {}).get("users", [])]

    def roles(self) -> list[str]:
        """etcd's roles (the Auth API; needs ``root``)."""
        return [str(r) for r in self._post("/v3/auth/role/list", {}).get("roles", [])]

    def db_size(self) -> tuple[int, int]:
        """(bytes on disk, bytes in use) of the backend."""
        status = self._post("/v3/maintenance/status", {})
        return int(status.get("dbSize", 0)), int(status.get("dbSizeInUse", 0))

    def compact_and_defragment(self) -> None:
        """Compact away every revision before the current one, then give the space back."""
        revision = int(self._post("/v3/maintenance/status", {})["header"]["revision"])
        self._post("/v3/kv/compaction", {"revision": revision, "physical": True}, timeout=300)
        self._post("/v3/maintenance/defragment", {}, timeout=300)

    def cpu_profile(self, seconds: int) -> bytes:
        """``--enable-pprof``'s CPU profile over ``seconds`` (gzipped profile.proto)."""
        return self._open(f"{self.url}/debug/pprof/profile?seconds={seconds}", seconds + 30)


_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    """A process' CPU seconds so far and its memory now, from ``/proc``."""

    cpu_s: float
    rss_mb: float
    peak_rss_mb: float


def usage(pid: int) -> Usage:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    memory = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                memory[name] = int(value.split()[0]) / 1024
    return Usage(cpu, memory.get("VmRSS", 0.0), memory.get("VmHWM", 0.0))
