"""How to reach etcd: endpoints, TLS files and credentials, parsed once at the edge."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Parse ``host:port[,host:port]`` (an ``http(s)://`` scheme is tolerated)."""
    endpoints = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not host or not port.isdigit():
            raise ValueError(f"bad etcd endpoint {item!r}: expected host:port")
        endpoints.append(Endpoint(host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {text!r}")
    return tuple(endpoints)


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd."""

    endpoints: tuple[Endpoint, ...]
    """Tried in order; the first that answers is used."""
    cacert: Path | None = None
    """CA bundle that signed the server certificate; enables TLS."""
    cert: Path | None = None
    """Client certificate (mutual TLS); needs ``key``."""
    key: Path | None = None
    """Client private key (mutual TLS); needs ``cert``."""
    user: str | None = None
    """etcd auth user; needs ``password``."""
    password: str | None = None
    request_timeout: timedelta = timedelta(seconds=5)
    """Deadline of one etcd request."""
    https: bool = False
    """TLS even without ``cacert`` (the system's trusted CAs then verify the server)."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("EtcdSettings.endpoints: at least one endpoint is required")
        if (self.cert is None) != (self.key is None):
            raise ValueError("EtcdSettings.cert and EtcdSettings.key must be given together")
        if (self.user is None) != (self.password is None):
            raise ValueError("EtcdSettings.user and EtcdSettings.password must be given together")
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"EtcdSettings.{name}: no such file {path}")

    @classmethod
    def from_endpoint_string(cls, text: str, **kwargs: Any) -> EtcdSettings:
        return cls(endpoints=parse_endpoints(text), **kwargs)

    @property
    def tls(self) -> bool:
        return self.https or self.cacert is not None or self.cert is not None

    def describe(self) -> str:
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{e}" for e in self.endpoints)

    @property
    def identity(self) -> str:
        """Who etcd takes this client for once its auth is on: the ``user`` (a token wins
        over the certificate), else the common name of the client certificate (etcd's
        ``--client-cert-auth``), else ``"anonymous"``."""
        if self.user is not None:
            return self.user
        if self.cert is not None:
            return certificate_cn(Path(self.cert)) or f"(no CN in {self.cert})"
        return "anonymous"


def certificate_cn(path: Path) -> str | None:
    """The subject common name of the first certificate in the PEM file ``path`` (None when
    it has none or cannot be read). Decoded by the ``ssl`` module's own certificate decoder
    (the one its tests use; the client image has no ``cryptography``)."""
    decode = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
    if decode is None:
        return None
    try:
        subject = decode(str(path)).get("subject", ())
    except (OSError, ssl.SSLError, ValueError):
        return None
    return next((value for rdn in subject for name, value in rdn if name == "commonName"), None)
