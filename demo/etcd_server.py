"""A local etcd server process on loopback: for `regroup demo`, tests and benchmarks.

Starts the real ``etcd`` binary on free loopback ports with its data in a given
directory, waits until it answers, and can be stopped, killed and restarted on the
same ports and data (to test that clients ride out an etcd restart). Its ports come from
``regroup.ports``; a first start that finds one taken moves to fresh ones.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from regroup.ports import START_ATTEMPTS, Draw, PortsTaken, free_ports

# etcd's fatal line when a listener cannot bind: "listen tcp 127.0.0.1:N: bind: address already in use".
_IN_USE = "address already in use"


@dataclass
class TlsFiles:
    """Server and client certificates for a TLS etcd (see ``make_tls_files``)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_for(self, cn: str | None) -> tuple[Path, Path]:
        """(certificate, key) of a client certificate for ``cn`` from this CA (``issue_client_certificate``)."""
        return issue_client_certificate(self.ca, cn)


@dataclass
class EtcdServer:
    """One etcd member on 127.0.0.1. Use ``start()``/``stop()`` or as a context manager."""

    data_dir: Path
    enable_v2: bool = False
    tls: TlsFiles | None = None
    host: str = "127.0.0.1"
    client_port: int = 0
    """0 (with ``peer_port`` 0): two distinct ports from ``draw_ports``, drawn again while
    the first start finds one taken. Given: etcd starts on it or fails naming it."""
    peer_port: int = 0
    """0 or given, as ``client_port``; never the same port as it."""
    log_path: Path | None = None
    extra_args: tuple[str, ...] = ()
    draw_ports: Draw = field(default=free_ports, repr=False)
    """Where ports left 0 come from: ``regroup.ports.free_ports``, or a test's stand-in."""
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _movable: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.client_port == 0) != (self.peer_port == 0):
            raise ValueError(
                f"EtcdServer.client_port and peer_port are both given or both 0 (drawn), "
                f"got {self.client_port} and {self.peer_port}"
            )
        if self.client_port == 0:
            self._draw()
            # Until etcd has served on them no client knows them: a start may move them.
            self._movable = True
        elif self.client_port == self.peer_port:
            raise ValueError(f"EtcdServer.client_port and peer_port must differ, both are {self.client_port}")

    def _draw(self) -> None:
        client, peer = self.draw_ports(2, self.host)
        if client == peer:
            raise ValueError(f"EtcdServer.draw_ports gave one port twice: {client}")
        self.client_port, self.peer_port = client, peer

    @property
    def endpoint(self) -> str:
        """``host:port`` as torchrun's ``--rdzv-endpoint`` and regroup expect it."""
        return f"{self.host}:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("etcd binary not found: apt-get install -y etcd-server")
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
            binary,
            "--name", "regroup-local",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"regroup-local={peer}",
            "--log-level", "error",
        ]  # fmt: skip
        if self.enable_v2:
            args.append("--enable-v2")
        if self.tls is not None:
            args += [
                "--cert-file", str(self.tls.server_cert),
                "--key-file", str(self.tls.server_key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        return args + list(self.extra_args)

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start etcd and wait until it answers. The first start of a server whose ports
        were drawn draws fresh ones while etcd finds one taken, ``START_ATTEMPTS`` times in
        all; later starts (after ``stop``/``kill``) keep the ports clients know. Raises
        ``PortsTaken`` naming the ports tried."""
        tried: list[tuple[int, int]] = []
        while True:
            try:
                self._launch(timeout)
            except PortsTaken as taken:
                tried.append((self.client_port, self.peer_port))
                if not self._movable or len(tried) >= START_ATTEMPTS:
                    raise PortsTaken(f"etcd (client, peer) in {self.data_dir}", tried, taken.detail) from taken
                self._draw()
                continue
            self._movable = False
            return self

    def _launch(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.data_dir.parent / f"etcd-{self.client_port}.log"
        with open(log_path, "ab") as log:
            since = log.tell()
            self._proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")},
            )  # fmt: skip
        self.wait_ready(timeout, log_path, since)

    def wait_ready(self, timeout: float, log_path: Path | None = None, since: int = 0) -> None:
        """Wait until etcd answers. Raises ``PortsTaken`` if it exited because a port was
        taken (its log from offset ``since`` says so), ``RuntimeError`` if it exited otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                tail = _read_from(log_path, since)[-2000:] if log_path else ""
                said = [line.strip() for line in tail.splitlines() if _IN_USE in line]
                if said:
                    raise PortsTaken("etcd (client, peer)", [(self.client_port, self.peer_port)], said[-1])
                raise RuntimeError(f"etcd exited with {code}: {tail}")
            if self._healthy():
                return
            time.sleep(0.05)
        raise TimeoutError(f"etcd at {self.url} not ready after {timeout}s")

    def _healthy(self) -> bool:
        if self.tls is not None:
            # /health needs a client certificate; a TCP accept is enough to move on, the
            # first client request retries until the server is serving.
            try:
                with socket.create_connection((self.host, self.client_port), timeout=0.2):
                    return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as response:
                return b"true" in response.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Kill abruptly, as a crashed etcd."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self, timeout: float = 30.0) -> None:
        """Stop and start again on the same ports and data."""
        self.stop()
        self.start(timeout)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def make_tls_files(directory: Path, host: str = "127.0.0.1") -> TlsFiles:
    """A throwaway CA with a server and a client certificate, via the openssl CLI. The
    server's certificate serves as a client's too: etcd's HTTP gateway presents it to etcd
    itself, which checks it under ``--client-cert-auth``. More clients:
    ``issue_client_certificate``."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=regroup-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (d / "san.ext").write_text(f"subjectAltName=IP:{host},DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name, cn in (("server", "etcd"), ("client", "regroup")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", f"{name}.crt")  # fmt: skip
    return TlsFiles(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


_ISSUING = threading.Lock()
_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2")


def _file_stem(cn: str | None) -> str:
    if cn is None:
        return "client-no-cn"
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in cn)
    # Two CNs that differ only where a character was replaced must not share files.
    return "client-" + (safe if safe == cn else f"{safe}-{hashlib.sha256(cn.encode()).hexdigest()[:8]}")


def issue_client_certificate(ca: Path, cn: str | None) -> tuple[Path, Path]:
    """(certificate, key) of a client certificate signed by the CA ``ca`` (its key ``ca.key``
    beside it, as ``make_tls_files`` leaves it), in ``ca``'s folder, issued once per CN
    there. EC keys: milliseconds each, so one per job is cheap. With etcd's
    ``--client-cert-auth`` and authentication on, the CN is the etcd user; ``cn=None``
    issues one without a CN, the only kind etcd 3.4's HTTP gateway (``/v3/...``) then
    accepts (it authenticates by token, never by a certificate's CN).

    Safe to call from threads and processes at once: the files appear whole (written under
    temporary names, then renamed, the key first)."""
    directory = ca.parent
    stem = _file_stem(cn)
    cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    with _ISSUING:
        if cert.is_file():
            return cert, key
        tmp = f"{stem}.{os.getpid()}.{threading.get_ident()}.tmp"
        subject = f"/CN={cn}" if cn is not None else "/O=regroup-no-cn"
        extensions = ("basicConstraints=critical,CA:FALSE", "extendedKeyUsage=clientAuth")
        subprocess.run(
            ["openssl", "req", "-x509", *_EC, "-subj", subject, "-CA", ca.name, "-CAkey", ca.with_suffix(".key").name,
             *[arg for e in extensions for arg in ("-addext", e)], "-keyout", f"{tmp}.key", "-out", f"{tmp}.crt"],
            check=True, capture_output=True, cwd=directory,
        )  # fmt: skip
        os.replace(directory / f"{tmp}.key", key)
        os.replace(directory / f"{tmp}.crt", cert)
    return cert, key
