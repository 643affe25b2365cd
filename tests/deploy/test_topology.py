"""The topology init container and the worker entrypoint, run as they run in a pod:
the script against a Kubernetes API over HTTP, the entrypoint under /bin/sh."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.schemas import REPO

SCRIPT = REPO / "deploy/topology/topology.py"
ENTRYPOINT = REPO / "deploy/topology/entrypoint.sh"
TOKEN = "token-for-the-worker-service-account"

AWS_GPU_NODE = {
    "metadata": {
        "name": "ip-10-0-1-7.ec2.internal",
        "labels": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "8",
            "topology.kubernetes.io/region": "us-east-1",
            "topology.kubernetes.io/zone": "us-east-1a",
            "node.kubernetes.io/instance-type": "p5.48xlarge",
            "topology.k8s.aws/network-node-layer-3": "nn-4b1c",
            "eks.amazonaws.com/nodegroup": "gpu",
        },
    },
    "spec": {"providerID": "aws:///us-east-1a/i-0abc"},
    "status": {"allocatable": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}},
}
KIND_NODE = {"metadata": {"name": "kind-worker", "labels": {"kubernetes.io/hostname": "kind-worker"}},
             "spec": {"providerID": "kind://docker/kind/kind-worker"}, "status": {"allocatable": {"cpu": "8"}}}


class FakeNodesApi(ThreadingHTTPServer):
    """Serves GET /api/v1/nodes/<name> like the API server: 401 without the token, 403 for listed nodes."""

    def __init__(self, nodes: dict[str, dict[str, Any]], forbidden: set[str]) -> None:
        self.nodes, self.forbidden, self.requests = nodes, forbidden, []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: FakeNodesApi

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.requests.append((self.path, self.headers.get("Authorization")))
        name = self.path.removeprefix("/api/v1/nodes/")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._reply(401, {"kind": "Status", "reason": "Unauthorized"})
        elif name in self.server.forbidden:
            self._reply(403, {"kind": "Status", "reason": "Forbidden"})
        elif name in self.server.nodes:
            self._reply(200, self.server.nodes[name])
        else:
            self._reply(404, {"kind": "Status", "reason": "NotFound"})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[FakeNodesApi]:
    server = FakeNodesApi({"ip-10-0-1-7.ec2.internal": AWS_GPU_NODE, "kind-worker": KIND_NODE}, forbidden={"locked"})
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def run_topology(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "topology" / "env"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--timeout", "3", *args],
        capture_output=True, text=True, timeout=30, env=env or {"PATH": "/usr/bin:/bin"}, check=False,
    )
    return result, out


def source(env_file: Path, preset: dict[str, str] | None = None) -> dict[str, str]:
    """The environment /bin/sh ends up with after sourcing the file, as the entrypoint does."""
    result = subprocess.run(
        ["/bin/sh", "-c", f'. "{env_file}" && env -0'], capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", **(preset or {})}, timeout=10, check=True,
    )
    return dict(item.split("=", 1) for item in result.stdout.split("\0") if "=" in item)


def api_url(api: FakeNodesApi) -> str:
    return f"http://127.0.0.1:{api.server_address[1]}"


def test_gpu_node_labels_become_the_env_the_entrypoint_sources(tmp_path: Path, api: FakeNodesApi, token: Path) -> None:
    result, out = run_topology(tmp_path, "--node", "ip-10-0-1-7.ec2.internal", "--api", api_url(api), "--token-file", str(token))
    assert result.returncode == 0, result.stderr
    env = source(out)
    assert env["REGROUP_TOPOLOGY_SOURCE"] == "api"
    assert env["REGROUP_GPU_PRODUCT"] == "NVIDIA-H100-80GB-HBM3"
    assert env["REGROUP_GPU_COUNT"] == "8"
    assert env["REGROUP_PROVIDER"] == "aws"
    assert (env["REGROUP_REGION"], env["REGROUP_ZONE"]) == ("us-east-1", "us-east-1a")
    assert env["REGROUP_INSTANCE_TYPE"] == "p5.48xlarge"
    assert env["REGROUP_NETWORK_BLOCK"] == "nn-4b1c"
    assert env["REGROUP_FABRIC"] == "efa"
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "REGROUP_TOPOLOGY_WARNING" not in env
    assert api.requests == [("/api/v1/nodes/ip-10-0-1-7.ec2.internal", f"Bearer {TOKEN}")]


def test_node_name_comes_from_the_downward_api_env(tmp_path: Path, api: FakeNodesApi, token: Path) -> None:
    result, out = run_topology(
        tmp_path, "--api", api_url(api), "--token-file", str(token),
        env={"PATH": "/usr/bin:/bin", "NODE_NAME": "kind-worker"},
    )
    assert result.returncode == 0, result.stderr
    env = source(out)
    assert env["REGROUP_PROVIDER"] == "kind"
    assert env["REGROUP_FABRIC"] == "tcp" and env["NCCL_IB_DISABLE"] == "1"
    # Missing labels degrade to empty values and a warning naming them.
    assert env["REGROUP_GPU_PRODUCT"] == ""
    assert "REGROUP_GPU_PRODUCT" in env["REGROUP_TOPOLOGY_WARNING"]


def test_forbidden_node_read_degrades_without_failing_the_pod(tmp_path: Path, api: FakeNodesApi, token: Path) -> None:
    result, out = run_topology(tmp_path, "--node", "locked", "--api", api_url(api), "--token-file", str(token))
    assert result.returncode == 0
    env = source(out)
    assert env["REGROUP_TOPOLOGY_SOURCE"] == "none"
    assert "403" in env["REGROUP_TOPOLOGY_ERROR"] and "may not get nodes" in env["REGROUP_TOPOLOGY_ERROR"]
    assert "degraded" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node", "kind-worker", "--token-file", "/nonexistent/token"], "no service account token"),
        (["--token-file", "TOKEN"], "NODE_NAME is not set"),
        (["--node", "kind-worker", "--token-file", "TOKEN", "--api", ""], "not in a cluster"),
    ],
    ids=["no-token", "no-node-name", "no-api"],
)
def test_missing_inputs_degrade_with_a_reason(tmp_path: Path, api: FakeNodesApi, token: Path, args: list[str], message: str) -> None:
    args = [str(token) if a == "TOKEN" else a for a in args]
    if "--api" not in args:
        args += ["--api", api_url(api)]
    result, out = run_topology(tmp_path, *args)
    assert result.returncode == 0
    env = source(out)
    assert env["REGROUP_TOPOLOGY_SOURCE"] == "none"
    assert message in env["REGROUP_TOPOLOGY_ERROR"]


def test_unreachable_api_degrades(tmp_path: Path, token: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = server.server_address[1]
    server.server_close()  # a port nobody listens on
    result, out = run_topology(tmp_path, "--node", "n", "--api", f"http://127.0.0.1:{port}", "--token-file", str(token))
    assert result.returncode == 0
    assert source(out)["REGROUP_TOPOLOGY_SOURCE"] == "none"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regroup_topology_script", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fabric_and_provider_detection() -> None:
    topology = _module()
    assert topology.fabric_of({}, {"rdma/hca_shared_devices_a": "1"}) == "infiniband"
    assert topology.fabric_of({"feature.node.kubernetes.io/rdma.available": "true"}, {}) == "infiniband"
    assert topology.fabric_of({}, {"vpc.amazonaws.com/efa": "0"}) == "tcp"
    assert topology.provider_of({}, "gce://project/us-central1-a/node") == "gcp"
    assert topology.provider_of({"cloud.google.com/gke-nodepool": "a3"}, "") == "gcp"
    assert topology.provider_of({"kubernetes.azure.com/cluster": "x"}, "") == "azure"
    assert topology.provider_of({}, "") == ""


def test_env_file_quotes_hostile_label_values(tmp_path: Path) -> None:
    topology = _module()
    hostile = "H100'; touch " + str(tmp_path / "pwned") + "; echo '$(id)"
    path = tmp_path / "env"
    path.write_text(topology.render_env_file({"REGROUP_GPU_PRODUCT": hostile}))
    assert source(path)["REGROUP_GPU_PRODUCT"] == hostile
    assert not (tmp_path / "pwned").exists()


def test_values_set_in_the_pod_spec_win_over_the_env_file(tmp_path: Path) -> None:
    topology = _module()
    path = tmp_path / "env"
    path.write_text(topology.render_env_file({"NCCL_IB_DISABLE": "1", "REGROUP_FABRIC": "tcp"}))
    env = source(path, preset={"NCCL_IB_DISABLE": "0"})
    assert env["NCCL_IB_DISABLE"] == "0" and env["REGROUP_FABRIC"] == "tcp"


# --- entrypoint ---------------------------------------------------------------------------


def run_entrypoint(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", str(ENTRYPOINT), "env"], capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", **env}, timeout=10, check=False,
    )


def _default_route_interface() -> str | None:
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            return fields[0]
    return None


def test_entrypoint_sources_topology_and_pins_the_socket_interface(tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    env_file.write_text(_module().render_env_file({"REGROUP_FABRIC": "efa", "FI_PROVIDER": "efa"}))
    result = run_entrypoint({"REGROUP_TOPOLOGY_ENV": str(env_file)})
    assert result.returncode == 0, result.stderr
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["REGROUP_FABRIC"] == "efa" and env["FI_PROVIDER"] == "efa"
    iface = _default_route_interface()
    if iface is None:
        assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    else:
        assert env["NCCL_SOCKET_IFNAME"] == iface and env["GLOO_SOCKET_IFNAME"] == iface


def test_entrypoint_keeps_an_interface_the_pod_spec_sets(tmp_path: Path) -> None:
    result = run_entrypoint({"REGROUP_TOPOLOGY_ENV": str(tmp_path / "missing"), "NCCL_SOCKET_IFNAME": "ens5"})
    assert result.returncode == 0
    assert "NCCL_SOCKET_IFNAME=ens5" in result.stdout.splitlines()
    assert "no topology file" in result.stderr  # degraded, but the command still ran


def test_entrypoint_passes_the_command_its_exit_status() -> None:
    result = subprocess.run(["/bin/sh", str(ENTRYPOINT), "sh", "-c", "exit 7"], capture_output=True, timeout=10, check=False)
    assert result.returncode == 7
