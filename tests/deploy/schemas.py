"""Offline validation of Kubernetes manifests, strict about unknown fields.

- Core kinds: the OpenAPI-derived JSON schemas that ``kubernetes-validate`` bundles
  (strict variant: ``additionalProperties: false`` everywhere), at each version in
  ``K8S_VERSIONS``.
- CRD kinds: the CRDs kept in ``deploy/crds/``, turned into JSON schemas the way the API
  server reads a structural schema (an object with ``properties`` and no
  ``x-kubernetes-preserve-unknown-fields`` knows all its fields), with the core types
  they embed resolved against the same bundled Kubernetes definitions.
- Manifest discovery: every YAML file under ``deploy/`` that is not a kustomize input (a
  patch, a generator source, a kustomization) is a complete manifest; every directory
  with a ``kustomization.yaml`` is rendered with ``kubectl kustomize`` and its output
  validated.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRD_DIR = DEPLOY / "crds"

K8S_VERSIONS = ("1.29", "1.37")
"""Oldest Kubernetes minor the manifests support, and the newest the validator bundles."""

DEFS_URI = "https://kubernetes.io/api/_definitions.json"

# Where a CRD embeds a core type, by (group, kind) and schema path ("*" = any list item
# or map value); the CRD files mark these spots x-kubernetes-preserve-unknown-fields.
EMBEDDED_CORE_TYPES: dict[tuple[str, str], dict[tuple[str, ...], str]] = {
    ("jobset.x-k8s.io", "JobSet"): {
        ("spec", "replicatedJobs", "*", "template", "spec"): "io.k8s.api.batch.v1.JobSpec",
    },
    ("kubeflow.org", "PyTorchJob"): {
        ("spec", "pytorchReplicaSpecs", "*", "template"): "io.k8s.api.core.v1.PodTemplateSpec",
        ("spec", "elasticPolicy", "metrics", "*"): "io.k8s.api.autoscaling.v2.MetricSpec",
    },
    ("kueue.x-k8s.io", "ResourceFlavor"): {
        ("spec", "nodeTaints", "*"): "io.k8s.api.core.v1.Taint",
        ("spec", "tolerations", "*"): "io.k8s.api.core.v1.Toleration",
    },
    ("kueue.x-k8s.io", "ClusterQueue"): {
        ("spec", "namespaceSelector"): "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector",
    },
    ("monitoring.coreos.com", "ServiceMonitor"): {
        ("spec", "selector"): "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector",
    },
}

# Core kinds that are not namespaced (an object of these must not name a namespace).
CLUSTER_SCOPED_CORE_KINDS = frozenset(
    {
        "Namespace", "Node", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass",
        "PriorityClass", "CustomResourceDefinition", "IngressClass", "RuntimeClass", "CSIDriver",
        "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "APIService",
    }
)

# JSON-schema keywords a structural CRD schema may carry over unchanged.
_PASSTHROUGH = (
    "type", "enum", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "required",
)


class InvalidManifest(ValueError):
    """A manifest does not match its schema; the message names the object and the field."""


@dataclass(frozen=True)
class CrdKind:
    """One served version of one CRD."""

    group: str
    version: str
    kind: str
    namespaced: bool
    schema: dict[str, Any]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of a file."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_crds(directory: Path = CRD_DIR) -> dict[tuple[str, str], CrdKind]:
    """Every served version of every CRD in ``directory``, by (apiVersion, kind)."""
    kinds: dict[tuple[str, str], CrdKind] = {}
    for path in sorted(directory.glob("*.yaml")):
        for crd in load_documents(path):
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                kind = CrdKind(
                    group=spec["group"],
                    version=version["name"],
                    kind=spec["names"]["kind"],
                    namespaced=spec["scope"] == "Namespaced",
                    schema=version["schema"]["openAPIV3Schema"],
                )
                kinds[(kind.api_version, kind.kind)] = kind
    return kinds


def crd_to_json_schema(
    node: dict[str, Any], embedded: dict[tuple[str, ...], str], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A strict JSON schema for one structural CRD schema node."""
    if path in embedded:
        return {"$ref": f"{DEFS_URI}#/$defs/{embedded[path]}"}
    if path == ("metadata",):
        return {"$ref": f"{DEFS_URI}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    out: dict[str, Any] = {key: copy.deepcopy(node[key]) for key in _PASSTHROUGH if key in node}
    if "anyOf" in node:
        out["anyOf"] = [crd_to_json_schema(option, embedded, path) for option in node["anyOf"]]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node:
        out["properties"] = {
            name: crd_to_json_schema(child, embedded, (*path, name)) for name, child in node["properties"].items()
        }
    if "items" in node:
        out["items"] = crd_to_json_schema(node["items"], embedded, (*path, "*"))
    additional = node.get("additionalProperties")
    if isinstance(additional, dict):
        out["additionalProperties"] = crd_to_json_schema(additional, embedded, (*path, "*"))
    elif node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        # Structural schema: an object lists all its fields; anything else is unknown.
        out["additionalProperties"] = False
    return out


def _schema_dir(version: str) -> Any:
    return resources.files("kubernetes_validate").joinpath("kubernetes-json-schema", f"v{version}.0-local-strict")


@functools.cache
def _definitions(version: str) -> Resource:
    return Resource.from_contents(json.loads(_schema_dir(version).joinpath("_definitions.json").read_text()))


def _core_schema_name(api_version: str, kind: str) -> str:
    # kubernetes-validate's file naming: rbac.authorization.k8s.io/v1 -> rbac-v1, apps/v1 -> apps-v1, v1 -> v1.
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{group_version}.json"


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> tuple[jsonschema.protocols.Validator, bool]:
    """(validator, namespaced) for one kind at one Kubernetes version."""
    crd = load_crds().get((api_version, kind))
    if crd is not None:
        embedded = EMBEDDED_CORE_TYPES.get((crd.group, crd.kind), {})
        schema = crd_to_json_schema(crd.schema, embedded)
        schema["properties"]["apiVersion"] = {"const": api_version}
        schema["properties"]["kind"] = {"const": kind}
        schema.setdefault("required", [])
        schema["required"] = sorted({*schema["required"], "apiVersion", "kind", "metadata"})
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        registry = _definitions(version) @ Registry()
        return jsonschema.Draft202012Validator(schema, registry=registry), crd.namespaced
    schema_file = _schema_dir(version).joinpath(_core_schema_name(api_version, kind))
    if not schema_file.is_file():
        raise InvalidManifest(
            f"{kind} ({api_version}): no schema at Kubernetes {version} and no CRD in deploy/crds: "
            "misspelt kind or apiVersion, or a CRD to add"
        )
    schema = json.loads(schema_file.read_text())
    registry = Resource.from_contents(schema) @ (_definitions(version) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry), kind not in CLUSTER_SCOPED_CORE_KINDS


def describe(doc: dict[str, Any]) -> str:
    metadata = doc.get("metadata") or {}
    where = f"{metadata['namespace']}/" if metadata.get("namespace") else ""
    return f"{doc.get('kind', '?')} {where}{metadata.get('name', '?')}"


def validate_object(doc: dict[str, Any], version: str) -> None:
    """Raise InvalidManifest naming every field of ``doc`` that its schema rejects."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        raise InvalidManifest(f"not a Kubernetes object (no apiVersion/kind): {str(doc)[:80]}")
    validator, namespaced = _validator(version, str(doc["apiVersion"]), str(doc["kind"]))
    problems = [
        f"{error.json_path}: {error.message}"
        for error in sorted(validator.iter_errors(doc), key=lambda e: e.json_path)
    ]
    if not namespaced and (doc.get("metadata") or {}).get("namespace"):
        problems.append(f"$.metadata.namespace: {doc['kind']} is cluster-scoped and takes no namespace")
    if problems:
        raise InvalidManifest(f"{describe(doc)} (Kubernetes {version}): " + "; ".join(problems[:5]))


def validate_crd_definition(crd: dict[str, Any], version: str) -> None:
    """The CRD objects themselves must be valid CustomResourceDefinitions."""
    validate_object(crd, version)


# --- discovery ----------------------------------------------------------------------------


def kustomization_dirs(root: Path = DEPLOY) -> list[Path]:
    """Every directory under ``root`` with a kustomization.yaml, sorted."""
    return sorted(path.parent for path in root.rglob("kustomization.yaml"))


def kustomize_inputs(root: Path = DEPLOY) -> set[Path]:
    """Files read by kustomize rather than applied: kustomizations, patches, generator sources."""
    inputs: set[Path] = set()
    for directory in kustomization_dirs(root):
        kustomization_file = directory / "kustomization.yaml"
        inputs.add(kustomization_file)
        (kustomization,) = load_documents(kustomization_file)
        for patch in kustomization.get("patches", []):
            if "path" in patch:
                inputs.add((directory / patch["path"]).resolve())
        for patch in kustomization.get("patchesStrategicMerge", []):
            inputs.add((directory / patch).resolve())
        for generator in kustomization.get("configMapGenerator", []) + kustomization.get("secretGenerator", []):
            for entry in generator.get("files", []):
                inputs.add((directory / entry.split("=", 1)[-1]).resolve())
    return {path.resolve() for path in inputs}


def manifest_files(root: Path = DEPLOY) -> list[Path]:
    """YAML files under ``root`` that must each be complete, valid Kubernetes objects."""
    inputs = kustomize_inputs(root)
    files = [p for p in sorted(root.rglob("*.y*ml")) if p.suffix in (".yaml", ".yml")]
    return [p for p in files if p.resolve() not in inputs and CRD_DIR not in p.parents]


def kubectl() -> str:
    """Path of kubectl; its absence is an error, not a reason to skip."""
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError("kubectl not found on PATH: rendering the kustomize overlays needs it (Debian package kubectl)")
    return path


@functools.cache
def _kustomize(directory: Path) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise InvalidManifest(f"kubectl kustomize {directory.relative_to(REPO)} failed: {result.stderr.strip()}")
    return result.stdout


def render(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize <directory>`` as a list of objects (fresh objects on every call)."""
    return [doc for doc in yaml.safe_load_all(_kustomize(directory.resolve())) if doc is not None]


# --- pod templates --------------------------------------------------------------------


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every pod an object creates."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "Pod":
        yield describe(doc), {"metadata": doc.get("metadata", {}), "spec": spec}
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield describe(doc), spec["template"]
    elif kind == "CronJob":
        yield describe(doc), spec["jobTemplate"]["spec"]["template"]
    elif kind == "JobSet":
        for replicated in spec.get("replicatedJobs", []):
            yield f"{describe(doc)} {replicated['name']}", replicated["template"]["spec"]["template"]
    elif kind == "PyTorchJob":
        for replica_type, replica in spec.get("pytorchReplicaSpecs", {}).items():
            yield f"{describe(doc)} {replica_type}", replica["template"]
