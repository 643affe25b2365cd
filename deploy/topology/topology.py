#!/usr/bin/env python3
"""Topology init container: write what this pod's node is as a shell env file.

Node labels are not available through the downward API, so this asks the Kubernetes
API for the pod's own node (``GET /api/v1/nodes/$NODE_NAME``, which the worker
ServiceAccount may do and nothing more) and writes, for the worker's entrypoint to
source:

- ``REGROUP_GPU_PRODUCT``, ``REGROUP_GPU_COUNT``, ``REGROUP_PROVIDER``, ``REGROUP_REGION``,
  ``REGROUP_ZONE``, ``REGROUP_INSTANCE_TYPE``, ``REGROUP_FABRIC`` (efa, infiniband or
  tcp), ``REGROUP_NETWORK_BLOCK`` (the closest network-topology label the provider sets);
- transport settings for NCCL that follow from the fabric.

It never fails the pod for lack of information: with no token, no permission, no
API or no labels it writes what it knows plus ``REGROUP_TOPOLOGY_ERROR`` and exits 0,
and NCCL falls back to probing as it would without regroup. Standard library only, so
it runs in any image with a Python 3.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

# Label keys by what they tell, first match wins. Sources: NVIDIA GPU feature discovery
# (nvidia.com/*), GKE (cloud.google.com/*), EKS and Karpenter (k8s.amazonaws.com,
# karpenter.k8s.aws, topology.k8s.aws), Kubernetes well-known labels (topology.kubernetes.io,
# node.kubernetes.io), Node Feature Discovery (feature.node.kubernetes.io).
GPU_PRODUCT_LABELS = (
    "nvidia.com/gpu.product",
    "cloud.google.com/gke-accelerator",
    "karpenter.k8s.aws/instance-gpu-name",
    "k8s.amazonaws.com/accelerator",
)
GPU_COUNT_LABELS = ("nvidia.com/gpu.count", "karpenter.k8s.aws/instance-gpu-count")
REGION_LABELS = ("topology.kubernetes.io/region", "failure-domain.beta.kubernetes.io/region")
ZONE_LABELS = ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone")
INSTANCE_TYPE_LABELS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")
NETWORK_BLOCK_LABELS = (
    "topology.k8s.aws/network-node-layer-3",
    "cloud.google.com/gce-topology-subblock",
    "cloud.google.com/gce-topology-block",
)
PROVIDER_BY_LABEL_PREFIX = (
    ("eks.amazonaws.com/", "aws"),
    ("cloud.google.com/gke-", "gcp"),
    ("kubernetes.azure.com/", "azure"),
)
PROVIDER_BY_ID_SCHEME = {"aws": "aws", "gce": "gcp", "azure": "azure", "kind": "kind", "oci": "oci"}

# Transport settings per fabric; the entrypoint applies them only where the pod spec
# did not set the variable itself.
NCCL_ENV_BY_FABRIC = {
    "efa": {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_IB_DISABLE": "1"},
    "infiniband": {"NCCL_IB_DISABLE": "0"},
    "tcp": {"NCCL_IB_DISABLE": "1"},
}


def _first_label(labels: dict[str, str], keys: tuple[str, ...]) -> str:
    for key in keys:
        if labels.get(key):
            return labels[key]
    return ""


def _positive_quantity(value: Any) -> bool:
    try:
        return int(str(value)) > 0
    except ValueError:
        return False


def fabric_of(labels: dict[str, str], allocatable: dict[str, Any]) -> str:
    """``efa`` or ``infiniband`` when the node advertises the device, else ``tcp``."""
    if _positive_quantity(allocatable.get("vpc.amazonaws.com/efa", 0)) or labels.get("vpc.amazonaws.com/efa.present") == "true":
        return "efa"
    rdma_resources = [k for k in allocatable if k.startswith("rdma/") or k.startswith("nvidia.com/rdma")]
    if any(_positive_quantity(allocatable[k]) for k in rdma_resources) or (
        labels.get("feature.node.kubernetes.io/rdma.available") == "true"
    ):
        return "infiniband"
    return "tcp"


def provider_of(labels: dict[str, str], provider_id: str) -> str:
    """Cloud provider from ``spec.providerID`` (``aws:///...``), else from label prefixes."""
    scheme = provider_id.split(":", 1)[0] if ":" in provider_id else ""
    if scheme:
        return PROVIDER_BY_ID_SCHEME.get(scheme, scheme)
    for prefix, provider in PROVIDER_BY_LABEL_PREFIX:
        if any(key.startswith(prefix) for key in labels):
            return provider
    return ""


def topology_env(node: dict[str, Any]) -> dict[str, str]:
    """The env file's variables for one Node object as the API returns it."""
    labels: dict[str, str] = node.get("metadata", {}).get("labels") or {}
    status = node.get("status") or {}
    allocatable: dict[str, Any] = status.get("allocatable") or {}
    fabric = fabric_of(labels, allocatable)
    env = {
        "REGROUP_TOPOLOGY_SOURCE": "api",
        "REGROUP_GPU_PRODUCT": _first_label(labels, GPU_PRODUCT_LABELS),
        "REGROUP_GPU_COUNT": _first_label(labels, GPU_COUNT_LABELS) or str(allocatable.get("nvidia.com/gpu", "")),
        "REGROUP_PROVIDER": provider_of(labels, (node.get("spec") or {}).get("providerID", "")),
        "REGROUP_REGION": _first_label(labels, REGION_LABELS),
        "REGROUP_ZONE": _first_label(labels, ZONE_LABELS),
        "REGROUP_INSTANCE_TYPE": _first_label(labels, INSTANCE_TYPE_LABELS),
        "REGROUP_NETWORK_BLOCK": _first_label(labels, NETWORK_BLOCK_LABELS),
        "REGROUP_FABRIC": fabric,
    }
    missing = [k for k in ("REGROUP_GPU_PRODUCT", "REGROUP_REGION", "REGROUP_ZONE") if not env[k]]
    if missing:
        env["REGROUP_TOPOLOGY_WARNING"] = "node has no label for " + ", ".join(missing)
    env.update(NCCL_ENV_BY_FABRIC[fabric])
    return env


def render_env_file(env: dict[str, str]) -> str:
    """Shell lines that set each variable only where the pod spec left it unset."""
    lines = ["# Written by the regroup topology init container; sourced by the worker entrypoint."]
    for key in sorted(env):
        lines.append(f'[ -n "${{{key}+x}}" ] || {key}={shlex.quote(env[key])}; export {key}')
    return "\n".join(lines) + "\n"


def fetch_node(api: str, node_name: str, token_file: str, ca_file: str, timeout: float) -> dict[str, Any]:
    """GET the Node object; raises OSError/ValueError with a readable message."""
    request = urllib.request.Request(f"{api.rstrip('/')}/api/v1/nodes/{node_name}")
    try:
        with open(token_file) as f:
            request.add_header("Authorization", f"Bearer {f.read().strip()}")
    except OSError as error:
        raise OSError(f"no service account token at {token_file} ({error.strerror})") from error
    context = None
    if api.startswith("https://"):
        context = ssl.create_default_context(cafile=ca_file if os.path.exists(ca_file) else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        reason = "forbidden: the pod's ServiceAccount may not get nodes" if error.code == 403 else error.reason
        raise OSError(f"GET node {node_name}: HTTP {error.code} {reason}") from error
    except urllib.error.URLError as error:
        raise OSError(f"GET node {node_name}: {error.reason}") from error


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".env-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def default_api() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write this node's topology as a shell env file.")
    parser.add_argument("--node", default=os.environ.get("NODE_NAME", ""), help="node name (default: $NODE_NAME)")
    parser.add_argument("--out", default="/etc/regroup/topology/env", help="env file to write")
    parser.add_argument("--api", default=default_api(), help="API server URL (default: in-cluster)")
    parser.add_argument("--token-file", default=f"{SERVICE_ACCOUNT_DIR}/token")
    parser.add_argument("--ca-file", default=f"{SERVICE_ACCOUNT_DIR}/ca.crt")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for the API request")
    args = parser.parse_args(argv)

    try:
        if not args.node:
            raise ValueError("NODE_NAME is not set: add it from the downward API (spec.nodeName)")
        if not args.api:
            raise ValueError("not in a cluster: KUBERNETES_SERVICE_HOST is not set")
        env = topology_env(fetch_node(args.api, args.node, args.token_file, args.ca_file, args.timeout))
    except (OSError, ValueError) as error:
        env = {"REGROUP_TOPOLOGY_SOURCE": "none", "REGROUP_TOPOLOGY_ERROR": str(error)}
        print(f"regroup-topology: degraded, NCCL will probe the transport itself: {error}", file=sys.stderr)
    write_atomically(args.out, render_env_file(env))
    print(json.dumps({"event": "topology written", "path": args.out, **env}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
