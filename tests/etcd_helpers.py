"""Helpers for tests on real etcd: restarting it under a running client, and an etcd with
authentication on (TLS, each client's certificate CN its etcd user)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regroup import cli
from regroup.demo.etcd_server import EtcdServer, TlsFiles, issue_client_certificate
from regroup.etcd import TRANSIENT_ERRORS, EtcdSettings, connect


async def put_retrying(client: Any, key: str, value: bytes, timeout: float = 60.0) -> None:
    """Put once the client's channel is back after an etcd restart (its first calls may
    fail); a failure is retried after a pause, since no event says the channel is back."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                await client.put(key.encode(), value)
                return
            except TRANSIENT_ERRORS:
                await asyncio.sleep(0.1)


async def lease_count(client: Any) -> int:
    """How many leases etcd holds (``LeaseLeases``, which aetcd's client does not wrap)."""
    from aetcd import rpc

    response = await client.leasestub.LeaseLeases(rpc.LeaseLeasesRequest(), timeout=10)
    return len(response.leases)


# --- etcd with authentication: client certificates, their CN as the etcd user -------------

_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2")


@dataclass(frozen=True)
class Pki:
    """A throwaway CA (openssl CLI, EC keys: fast) that signs etcd's server certificate and
    a client certificate for any CN (``client``): etcd with ``--client-cert-auth`` takes the
    CN for the user."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @classmethod
    def make(cls, directory: Path, host: str = "127.0.0.1") -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        pki = cls(directory)
        pki._openssl("req", "-x509", *_EC, "-subj", "/CN=regroup-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
        pki._issue("server", "etcd", f"subjectAltName=IP:{host},DNS:localhost", "extendedKeyUsage=serverAuth")
        return pki

    def client(self, cn: str) -> tuple[Path, Path]:
        """(certificate, key) whose subject CN is ``cn``, issued once (agents in threads of
        one test may ask for the same at once)."""
        return issue_client_certificate(self.ca, cn)

    def _issue(self, name: str, cn: str, *extensions: str) -> None:
        ext = [arg for e in ("basicConstraints=critical,CA:FALSE", *extensions) for arg in ("-addext", e)]
        self._openssl("req", "-x509", *_EC, "-subj", f"/CN={cn}", "-CA", "ca.crt", "-CAkey", "ca.key", *ext,
                      "-keyout", f"{name}.key", "-out", f"{name}.crt")  # fmt: skip

    def _openssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.directory)


@dataclass
class AuthEtcd:
    """A TLS etcd with ``--client-cert-auth`` whose auth was bootstrapped by the real
    ``regroup etcd-auth bootstrap`` (users ``root`` and ``CONTROLLER``, both of role root)."""

    server: EtcdServer
    pki: Pki
    bootstrapped: str = ""
    """What the first bootstrap printed."""

    CONTROLLER = "regroup-controller"

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def settings(self, cn: str) -> EtcdSettings:
        """How a client whose certificate's CN is ``cn`` reaches this etcd."""
        cert, key = self.pki.client(cn)
        return EtcdSettings.from_endpoint_string(self.server.endpoint, cacert=self.pki.ca, cert=cert, key=key)

    def tls_args(self, cn: str) -> list[str]:
        """The etcd flags of ``regroup controller`` and ``regroup etcd-auth`` for ``cn``."""
        cert, key = self.pki.client(cn)
        return ["--etcd", self.server.endpoint, "--etcd-cacert", str(self.pki.ca), "--etcd-cert", str(cert),
                "--etcd-key", str(key)]  # fmt: skip

    def rdzv_conf(self, cn: str) -> dict[str, str]:
        """torchrun's ``--rdzv-conf`` TLS keys for ``cn``."""
        cert, key = self.pki.client(cn)
        return {"cacert": str(self.pki.ca), "cert": str(cert), "key": str(key)}

    @contextlib.asynccontextmanager
    async def client(self, cn: str) -> AsyncIterator[Any]:
        """A connected client as ``cn``, closed after the block."""
        client = await connect(self.settings(cn))
        try:
            yield client
        finally:
            await client.close()


def bootstrap_cli(auth: AuthEtcd) -> tuple[int, str]:
    """Run ``regroup etcd-auth bootstrap`` in this process as etcd's root; (exit code, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["etcd-auth", "bootstrap", "--controller-user", AuthEtcd.CONTROLLER, *auth.tls_args("root")])
    return code, out.getvalue()


@contextlib.contextmanager
def auth_etcd(directory: Path) -> Iterator[AuthEtcd]:
    """A TLS etcd with client-certificate auth, bootstrapped, killed after the block. Its
    data and certificates live in ``directory``. Synchronous, so a module-scoped fixture can
    share one between tests (each test uses jobs of its own)."""
    pki = Pki.make(directory / "pki")
    root_cert, root_key = pki.client("root")
    tls = TlsFiles(pki.ca, directory / "pki" / "server.crt", directory / "pki" / "server.key", root_cert, root_key)
    server = EtcdServer(data_dir=directory / "etcd", tls=tls)
    server.start()
    try:
        auth = AuthEtcd(server, pki)
        code, auth.bootstrapped = bootstrap_cli(auth)
        assert code == 0, auth.bootstrapped
        yield auth
    finally:
        server.kill()
