"""Worker pods of the examples wired to regroup: regroup-run --standby (plain torchrun only
where an example says why), Jobs that bring back a node that left, training configs that
fit every world size, gang admission and TLS variants."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import pytest

from regroup.exit_codes import LEFT_JOB
from tests.deploy.lookup import EXAMPLE_FILES, container_env, flag_value
from tests.deploy.schemas import DEPLOY, REPO, describe, load_documents, pod_specs, render


def _worker_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                if "regroup.dev/job" in template["metadata"].get("labels", {}):
                    yield f"{path.relative_to(REPO)}: {where}", template


WORKERS = list(_worker_templates())


def test_every_workload_kind_has_an_example() -> None:
    kinds = {where.split(": ")[1].split(" ")[0] for where, _ in WORKERS}
    assert {"StatefulSet", "Job", "JobSet", "PyTorchJob"} <= kinds


ENTRYPOINT = "/opt/regroup/bin/regroup-entrypoint"

# Examples that launch with plain torchrun on purpose, and why. Every other worker runs
# `regroup-run --standby`, so a slip back to torchrun fails the tests below.
TORCHRUN_EXAMPLES = {
    "deploy/examples/smoke-job.yaml": "regroup.elastic.smoke is a one-shot check without ElasticWorld: nothing to re-form",
}


def _file(where: str) -> str:
    return where.split(": ")[0]


def _runs_the_trainer(container: dict[str, Any]) -> bool:
    words = container.get("command", []) + container.get("args", [])
    return any(flag == "-m" and module == "regroup.trainer" for flag, module in zip(words, words[1:]))


def _example_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                spec = template["spec"]
                for container in spec.get("initContainers", []) + spec["containers"]:
                    yield f"{path.relative_to(REPO)}: {where} {container['name']}", container


EXAMPLE_CONTAINERS = list(_example_containers())
TRAINER_CONTAINERS = [(w, c) for w, c in EXAMPLE_CONTAINERS if _runs_the_trainer(c)]


@pytest.mark.parametrize(("where", "template"), WORKERS, ids=[w for w, _ in WORKERS])
def test_worker_pod_is_wired_to_regroup(where: str, template: dict[str, Any]) -> None:
    job = template["metadata"]["labels"]["regroup.dev/job"]
    annotations = template["metadata"]["annotations"]
    low, high = int(annotations["regroup.dev/min-nodes"]), int(annotations["regroup.dev/max-nodes"])
    assert 1 <= low <= high
    for key in ("regroup.dev/checkpoint-timeout", "regroup.dev/join-window"):
        assert re.fullmatch(r"\d+(ms|s|m|h)", annotations[key]), key
    assert re.fullmatch(r"\d+/\d+(s|m|h)", annotations["regroup.dev/restart-storm"])
    spec = template["spec"]
    (trainer,) = spec["containers"]
    launcher = "torchrun" if _file(where) in TORCHRUN_EXAMPLES else "regroup-run"
    assert trainer["command"] == [ENTRYPOINT, launcher]
    args = trainer["args"]
    assert flag_value(args, "rdzv-backend") == "etcd-v3"
    assert flag_value(args, "rdzv-id") == job
    assert flag_value(args, "rdzv-endpoint") == annotations["regroup.dev/rdzv-endpoint"]
    assert flag_value(args, "nnodes") == (f"{low}:{high}" if low != high else str(low))
    gpus = int(flag_value(args, "nproc-per-node"))
    on_kind = "deploy/examples/kind/" in where
    if on_kind:
        assert "nvidia.com/gpu" not in trainer["resources"]["limits"]
    else:
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    env = container_env(trainer)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # On a one-node kind cluster every worker shares the node, so members are named by pod.
    node_source = "metadata.name" if on_kind else "spec.nodeName"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": node_source}}
    # The topology init container writes the env file into an emptyDir the trainer reads.
    (topology,) = [c for c in spec["initContainers"] if c["name"] == "topology"]
    assert topology["command"][0] == "/opt/regroup/bin/regroup-topology"
    out = topology["command"][topology["command"].index("--out") + 1]
    assert container_env(topology)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (init_mount,) = [m for m in topology["volumeMounts"] if out.startswith(m["mountPath"] + "/")]
    assert "emptyDir" in volumes[init_mount["name"]]
    assert any(m["name"] == init_mount["name"] and m["mountPath"] == init_mount["mountPath"] for m in trainer["volumeMounts"])
    assert spec["terminationGracePeriodSeconds"] >= 60
    if launcher == "regroup-run":
        # SIGTERM is a notice: the agent trains on for the pod's grace, which it cannot read.
        assert float(flag_value(args, "term-grace")) == spec["terminationGracePeriodSeconds"]


def _worker_jobs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, Job spec) of every Job, a JobSet's included, whose pods are regroup-run workers."""
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            if doc.get("kind") == "Job":
                specs = [doc["spec"]]
            elif doc.get("kind") == "JobSet":
                specs = [r["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
            else:
                continue
            for spec in specs:
                template = spec["template"]
                if "regroup.dev/job" in template["metadata"].get("labels", {}) and any(
                    c.get("command") == [ENTRYPOINT, "regroup-run"] for c in template["spec"]["containers"]
                ):
                    yield f"{path.relative_to(REPO)}: {describe(doc)}", spec


WORKER_JOBS = list(_worker_jobs())


@pytest.mark.parametrize(("where", "job"), WORKER_JOBS, ids=[w for w, _ in WORKER_JOBS])
def test_a_worker_job_brings_back_a_node_that_left_and_counts_no_disruption(where: str, job: dict[str, Any]) -> None:
    """Exit 75 (a node left a job that goes on) and a disruption are not failures of the Job:
    the index comes back as a fresh pod instead of counting against the backoff limit (or,
    with exit 0, being done for good)."""
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    exit_rules = [r["onExitCodes"] for r in rules if r["action"] == "Ignore" and "onExitCodes" in r]
    assert {"containerName": "trainer", "operator": "In", "values": [LEFT_JOB]} in exit_rules, rules


def test_worker_jobs_are_found() -> None:
    assert len(WORKER_JOBS) >= 3, WORKER_JOBS


def test_trainer_launching_examples_are_found() -> None:
    files = {_file(w) for w, _ in TRAINER_CONTAINERS}
    assert len(files) >= 8, files
    assert {_file(w) for w, _ in TRAINERS} <= files


@pytest.mark.parametrize(("where", "container"), TRAINER_CONTAINERS, ids=[w for w, _ in TRAINER_CONTAINERS])
def test_every_trainer_launching_example_uses_regroup_run_with_standby(where: str, container: dict[str, Any]) -> None:
    from regroup.rendezvous.inplace.launcher import build_parser

    if _file(where) in TORCHRUN_EXAMPLES:
        assert container["command"] == [ENTRYPOINT, "torchrun"]
        return
    # In-place re-forms, and a joining node starts its workers while the round forms.
    assert container["command"] == [ENTRYPOINT, "regroup-run"], "the trainer launches with regroup-run, not torchrun"
    assert container["args"][0] == "--standby"
    # The launcher's own parser takes the flags: --standby before the script, in place on.
    parsed = build_parser().parse_args(container["args"])
    assert parsed.standby is True and parsed.in_place == "auto"
    assert parsed.module is True and parsed.training_script == "regroup.trainer"
    assert "--standby" not in parsed.training_script_args


@pytest.mark.parametrize(("where", "container"), EXAMPLE_CONTAINERS, ids=[w for w, _ in EXAMPLE_CONTAINERS])
def test_every_module_an_example_runs_is_one_the_distribution_installs(where: str, container: dict[str, Any]) -> None:
    """One import name: ``-m trainer`` (the repository's folder) does not exist once installed."""
    words = container.get("command", []) + container.get("args", [])
    for flag, module in zip(words, words[1:]):
        if flag == "-m":
            assert module.split(".")[0] in ("regroup", "torch"), f"{where}: -m {module}"
            assert importlib.util.find_spec(module) is not None, f"{where}: -m {module}: no such module"


@pytest.mark.parametrize(("where", "container"), EXAMPLE_CONTAINERS, ids=[w for w, _ in EXAMPLE_CONTAINERS])
def test_plain_torchrun_only_where_an_example_says_why(where: str, container: dict[str, Any]) -> None:
    words = container.get("command", []) + container.get("args", [])
    if not any(w == "torchrun" or w.endswith("/torchrun") or w == "torch.distributed.run" for w in words):
        return
    assert _file(where) in TORCHRUN_EXAMPLES, f"{where} launches with torchrun; use regroup-run --standby"


@pytest.mark.parametrize("path", sorted(TORCHRUN_EXAMPLES))
def test_torchrun_exceptions_are_current_and_explained(path: str) -> None:
    from torch.distributed.run import get_args_parser

    text = (REPO / path).read_text()
    assert any(line.strip().startswith("#") and "torchrun" in line for line in text.splitlines()), (
        f"{path} must say in a comment why it keeps torchrun"
    )
    containers = [c for w, c in EXAMPLE_CONTAINERS if _file(w) == path and c.get("command", [None])[-1] == "torchrun"]
    assert containers, f"{path} no longer launches with torchrun: drop it from TORCHRUN_EXAMPLES"
    for container in containers:
        assert "--standby" not in container["args"]  # torchrun has no such flag
        get_args_parser().parse_args(container["args"])


def test_checkpoint_claim_is_read_write_many() -> None:
    (claim,) = [d for d in load_documents(DEPLOY / "examples/common/checkpoints-pvc.yaml")]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


# Training jobs (the smoke job runs regroup.elastic.smoke, which takes no config).
TRAINERS = [(w, t) for w, t in WORKERS if "regroup.trainer" in t["spec"]["containers"][0]["args"]]


@pytest.mark.parametrize(("where", "template"), TRAINERS, ids=[w for w, _ in TRAINERS])
def test_training_example_checkpoints_to_a_shared_volume_and_its_config_fits_every_world_size(
    where: str, template: dict[str, Any]
) -> None:
    from regroup.trainer.config_loading import load_config

    spec = template["spec"]
    (trainer,) = spec["containers"]
    # Checkpoints go to a claim every rank can read after a resize (ReadWriteMany; on a
    # one-node kind cluster, ReadWriteOnce shared by the pods of that node).
    on_kind = "deploy/examples/kind/" in where
    (checkpoints,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert checkpoints["persistentVolumeClaim"]["claimName"] == ("regroup-checkpoints-kind" if on_kind else "regroup-checkpoints")
    (checkpoint_mount,) = [m for m in trainer["volumeMounts"] if m["name"] == checkpoints["name"]]
    assert checkpoint_mount["mountPath"] == "/checkpoints"
    args = trainer["args"]
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    env = {"REGROUP_ETCD_ENDPOINT": container_env(trainer)["REGROUP_ETCD_ENDPOINT"], "TORCHELASTIC_RUN_ID": flag_value(args, "rdzv-id")}
    # The file the pod reads: the ConfigMap key mounted at the --config path.
    config_path = args[args.index("--config") + 1]
    (mount,) = [m for m in trainer["volumeMounts"] if m["mountPath"] == config_path]
    (generator,) = load_documents(DEPLOY / "examples/common/kustomization.yaml")[0]["configMapGenerator"]
    assert mount["subPath"] in generator["files"]
    config = load_config(DEPLOY / "examples/common" / mount["subPath"], overrides, env)
    assert config.checkpoint.dir == f"/checkpoints/{flag_value(args, 'rdzv-id')}", "jobs must not share a checkpoint folder"
    low, high = (int(n) for n in flag_value(args, "nnodes").split(":"))
    gpus = int(flag_value(args, "nproc-per-node"))
    for nodes in range(low, high + 1):
        assert config.batch.global_batch_size % (nodes * gpus) == 0, f"{nodes} nodes"


def test_gang_admission_variants() -> None:
    (kueue_job,) = [d for d in load_documents(DEPLOY / "examples/kueue/indexed-job.yaml") if d["kind"] == "Job"]
    queues = load_documents(DEPLOY / "examples/kueue/queues.yaml")
    local_queue = next(d for d in queues if d["kind"] == "LocalQueue")
    assert kueue_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local_queue["metadata"]["name"]
    template = kueue_job["spec"]["template"]
    assert kueue_job["metadata"]["annotations"]["kueue.x-k8s.io/job-min-parallelism"] == template["metadata"]["annotations"]["regroup.dev/min-nodes"]
    cluster_queue = next(d for d in queues if d["kind"] == "ClusterQueue")
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]

    volcano = load_documents(DEPLOY / "examples/volcano/statefulset.yaml")
    group = next(d for d in volcano if d["kind"] == "PodGroup")
    workload = next(d for d in volcano if d["kind"] == "StatefulSet")
    pod = workload["spec"]["template"]
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
    assert group["spec"]["minMember"] == int(pod["metadata"]["annotations"]["regroup.dev/min-nodes"])

    (smoke,) = [d for d in load_documents(DEPLOY / "examples/smoke-job.yaml") if d["kind"] == "Job"]
    assert smoke["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local_queue["metadata"]["name"]
    args = smoke["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["-m", "regroup.elastic.smoke"]
    assert smoke["spec"]["parallelism"] == smoke["spec"]["completions"] == int(flag_value(args, "nnodes"))
    # A failed check must fail the Job, not retry until it passes.
    assert smoke["spec"]["backoffLimit"] == 0 and flag_value(args, "max-restarts") == "0"


def test_tls_worker_uses_the_client_certificate_it_is_issued() -> None:
    (certificate,) = load_documents(DEPLOY / "examples/tls/worker-etcd-client.yaml")
    (workload,) = [d for d in load_documents(DEPLOY / "examples/tls/statefulset.yaml") if d["kind"] == "StatefulSet"]
    spec = workload["spec"]["template"]["spec"]
    (secret_volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert secret_volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert certificate["metadata"]["namespace"] == workload["metadata"]["namespace"]
    (trainer,) = spec["containers"]
    (mount,) = [m for m in trainer["volumeMounts"] if m["name"] == secret_volume["name"]]
    conf = dict(item.split("=", 1) for item in flag_value(trainer["args"], "rdzv-conf").split(","))
    assert set(conf) == {"cacert", "cert", "key"}
    for key, path in conf.items():
        assert path.startswith(mount["mountPath"] + "/"), key
        assert f"etcd.{key}={path}" in trainer["args"], "the trainer's etcd channel uses the same certificate"
    # The prod issuer that signs it is the one the etcd server trusts.
    prod = render(DEPLOY / "overlays/prod")
    issuers = {d["metadata"]["name"] for d in prod if d["kind"] == "ClusterIssuer"}
    assert certificate["spec"]["issuerRef"]["name"] in issuers
