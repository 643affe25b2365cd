"""What the benchmark reads: etcd's ``/metrics`` and its JSON gateway, and ``/proc`` of a pid.

etcd serves ``/metrics`` and the gRPC gateway (``/v3/...``) on its client URL, so the
lease list, key counts, compaction and defragmentation need no client of their own.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.request
from dataclasses import dataclass
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


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read() or b"{}"))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


@dataclass
class EtcdGateway:
    """etcd's client URL (``http://host:port``)."""

    url: str

    def metrics(self) -> dict[str, float]:
        """Every sample of ``COUNTERS`` and ``GAUGES`` (summed over labels), and the gRPC calls
        and streams started by method as ``grpc:<method>`` (a lease keep-alive is a stream)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
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
        return len(_post(self.url, "/v3/lease/leases", {}).get("leases", []))

    def count(self, prefix: str) -> int:
        """Keys under ``prefix``."""
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True}
        return int(_post(self.url, "/v3/kv/range", body).get("count", 0))

    def keys(self, prefix: str, limit: int = 20) -> list[str]:
        """The first ``limit`` keys under ``prefix``."""
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "keys_only": True, "limit": limit}
        return [base64.b64decode(kv["key"]).decode() for kv in _post(self.url, "/v3/kv/range", body).get("kvs", [])]

    def db_size(self) -> tuple[int, int]:
        """(bytes on disk, bytes in use) of the backend."""
        status = _post(self.url, "/v3/maintenance/status", {})
        return int(status.get("dbSize", 0)), int(status.get("dbSizeInUse", 0))

    def compact_and_defragment(self) -> None:
        """Compact away every revision before the current one, then give the space back."""
        revision = int(_post(self.url, "/v3/maintenance/status", {})["header"]["revision"])
        _post(self.url, "/v3/kv/compaction", {"revision": revision, "physical": True}, timeout=300)
        _post(self.url, "/v3/maintenance/defragment", {}, timeout=300)

    def cpu_profile(self, seconds: int) -> bytes:
        """``--enable-pprof``'s CPU profile over ``seconds`` (gzipped profile.proto)."""
        with urllib.request.urlopen(f"{self.url}/debug/pprof/profile?seconds={seconds}", timeout=seconds + 30) as response:
            return bytes(response.read())


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
