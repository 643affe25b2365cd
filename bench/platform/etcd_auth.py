"""Authentication on (``--auth on``): one etcd for every job, each job its own etcd user.

As a platform runs it (``regroup.etcd.auth``):

- etcd serves TLS with ``--client-cert-auth``: a client certificate's CN is its etcd user;
- ``regroup etcd-auth bootstrap --controller-user regroup-controller``, the command the
  platform's one-shot Job runs, as etcd's ``root`` by its certificate, turns authentication on;
- the controller presents the certificate of ``regroup-controller`` and runs with
  ``--etcd-job-identities``: it makes each job's user and role once it sees the job's pods
  and removes them at the job's clean-up;
- each job's agents (``--rdzv-conf cacert=,cert=,key=``) and rank 0 (``EtcdConfig``) present
  the job's own certificate, CN ``regroup:job:<namespace>:<job>`` (``JobTls``). Started
  before the controller made their identity, they are refused and retry.

The harness' part: a throwaway CA (``make_tls_files``) issues the certificates, and the
benchmark observes through etcd's gateway as ``OBSERVER``, a password user of role ``root``
made just before the bootstrap, while authentication is still off: etcd 3.4's gateway takes
no certificate CN (``observe``). Nothing of regroup's uses it.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.platform.agent_specs import JobTls
from bench.platform.observe import EtcdGateway, GatewayAccess
from regroup.demo.etcd_server import EtcdServer, TlsFiles, make_tls_files
from regroup.etcd.auth import ROOT, job_user
from regroup.keys import JobKeys

CONTROLLER_USER = "regroup-controller"
"""The controller's etcd user: its certificate's CN (``bootstrap --controller-user``)."""
OBSERVER = "regroup-bench-observer"
"""The benchmark's own user, for the gateway (a password, role ``root``)."""
BOOTSTRAP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PlatformAuth:
    """The certificates of an etcd with authentication on, and the observer's password.
    Client certificates are issued on first use, one per CN (milliseconds each)."""

    tls: TlsFiles
    """etcd's CA and server certificate (its ``client_cert`` is not used)."""
    observer_password: str

    @classmethod
    def make(cls, directory: Path) -> PlatformAuth:
        """A fresh CA in ``directory``, with the certificates of ``root`` and the controller."""
        auth = cls(make_tls_files(directory), secrets.token_urlsafe(16))
        for cn in (ROOT, CONTROLLER_USER, None):
            auth.tls.client_for(cn)
        return auth

    def etcd_flags(self, cn: str) -> list[str]:
        """``--etcd-cacert``, ``--etcd-cert``, ``--etcd-key`` of ``regroup controller`` and
        ``regroup etcd-auth`` presenting the certificate of ``cn``."""
        cert, key = self.tls.client_for(cn)
        return ["--etcd-cacert", str(self.tls.ca), "--etcd-cert", str(cert), "--etcd-key", str(key)]

    def controller_flags(self) -> list[str]:
        """What ``regroup controller`` adds: its certificate, and one etcd identity per job
        (removed 5 s after the job is gone, so the end of a size waits for it less)."""
        return [*self.etcd_flags(CONTROLLER_USER), "--etcd-job-identities", "--etcd-identity-grace", "5s"]

    def job(self, namespace: str, job: str) -> JobTls:
        """The certificate a job's agents and rank 0 present: CN ``regroup:job:<namespace>:<job>``."""
        cert, key = self.tls.client_for(job_user(JobKeys(namespace, job)))
        return JobTls(str(self.tls.ca), str(cert), str(key))

    def gateway_access(self) -> GatewayAccess:
        cert, key = self.tls.client_for(None)
        return GatewayAccess(self.tls.ca, cert, key, OBSERVER, self.observer_password)


async def bootstrap(etcd: EtcdServer, auth: PlatformAuth, gateway: EtcdGateway, log: Path) -> str:
    """The observer (while authentication is off), then ``regroup etcd-auth bootstrap`` as
    etcd's root, as a process of its own as the platform runs it; then ``gateway`` logs in.
    What the bootstrap printed; ``RuntimeError`` with its output if it failed."""
    await asyncio.to_thread(gateway.wait_serving)
    await asyncio.to_thread(gateway.add_root_user, OBSERVER, auth.observer_password)
    command = [sys.executable, "-m", "regroup.cli", "etcd-auth", "bootstrap", "--controller-user", CONTROLLER_USER,
               "--etcd", etcd.endpoint, *auth.etcd_flags(ROOT)]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT)  # fmt: skip
    try:
        async with asyncio.timeout(BOOTSTRAP_TIMEOUT_S):
            out, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    text = out.decode(errors="replace")
    with open(log, "a") as file:
        file.write(f"$ {' '.join(command)}\n{text}")
    if process.returncode != 0:
        raise RuntimeError(f"regroup etcd-auth bootstrap exited with {process.returncode}: {text[-2000:]}")
    await asyncio.to_thread(gateway.login)
    return text
