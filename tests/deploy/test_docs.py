"""docs/deploy.md only points at files, objects and flags that exist."""

from __future__ import annotations

import re

from tests.deploy.schemas import DEPLOY, REPO, render

DOC = (REPO / "docs/deploy.md").read_text()


def test_every_path_the_guide_names_exists() -> None:
    paths = set(re.findall(r"(?<![\w/])((?:deploy|docs|tests)/[\w./-]*\w)", DOC))
    # kubectl's deploy/<name> is a Deployment, not a path (checked below).
    paths = {p for p in paths if not p.startswith("deploy/regroup-")}
    assert len(paths) >= 15
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == []


def test_objects_the_guide_waits_on_are_the_ones_deployed() -> None:
    prod = render(DEPLOY / "overlays/prod")
    dev = render(DEPLOY / "overlays/dev")
    names = {(d["kind"].lower(), d["metadata"]["name"]) for d in prod + dev}
    mentioned = set(re.findall(r"\b(deploy|statefulset|certificate|svc|job)/(regroup-[\w-]+)", DOC))
    kinds = {"deploy": "deployment", "svc": "service"}
    assert mentioned
    for kind, name in mentioned:
        assert (kinds.get(kind, kind), name) in names, f"{kind}/{name}"


def test_alerts_the_guide_lists_are_the_ones_defined() -> None:
    rules = (DEPLOY / "observability/monitoring/prometheusrule.yaml").read_text()
    defined = set(re.findall(r"alert: (\w+)", rules))
    listed = set(re.findall(r"`(Regroup\w+)`", DOC))
    assert listed == defined
