"""Looking things up in the manifests: the example files, one object by kind and name, a
container's environment, a flag's value."""

from __future__ import annotations

from typing import Any

from tests.deploy.schemas import DEPLOY, manifest_files

EXAMPLE_FILES = [p for p in manifest_files() if DEPLOY / "examples" in p.parents]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def flag_value(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value
