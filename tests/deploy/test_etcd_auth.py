"""etcd auth as the prod overlay sets it up: etcd demands client certificates from the
regroup CA, a one-shot Job (etcd's root, by a certificate no other pod mounts) turns auth
on, the controller holds its own identity and makes one per job, each worker certificate
names its own job, and approver-policy signs a job identity only for the namespace that
asks (docs/deploy.md, "etcd auth: one identity per job")."""

from __future__ import annotations

import argparse
import asyncio
import copy
import fnmatch
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from regroup.controller import etcd_auth as etcd_auth_command
from regroup.controller import main as controller_command
from regroup.demo.etcd_server import EtcdServer, TlsFiles, make_tls_files
from regroup.etcd import EtcdSettings, connect
from regroup.etcd.auth import ROOT, bootstrap, ensure_job_identity, job_user
from regroup.keys import JobKeys
from regroup.records import Progress
from tests.deploy.lookup import EXAMPLE_FILES, container_env, flag_value, one
from tests.deploy.schemas import (
    DEPLOY,
    K8S_VERSIONS,
    REPO,
    InvalidManifest,
    describe,
    load_documents,
    pod_specs,
    render,
    validate_object,
)

CA_ISSUERS = {"regroup-etcd-ca", "regroup-selfsigned"}


@pytest.fixture(scope="module")
def prod() -> list[dict[str, Any]]:
    return render(DEPLOY / "overlays/prod")


def _examples() -> list[dict[str, Any]]:
    return [doc for path in EXAMPLE_FILES for doc in load_documents(path)]


def _parse(add_arguments: Any, args: list[str]) -> argparse.Namespace:
    """``args`` as the command's own parser reads them (argparse errors raise, not exit)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    try:
        return parser.parse_args(args)
    except SystemExit as exc:  # a subparser's error still exits
        raise AssertionError(f"the command refuses {args}") from exc


def _expand(args: list[str], container: dict[str, Any], values: dict[str, str]) -> list[str]:
    """The kubelet's ``$(VAR)`` expansion, with ``values`` for the downward-API variables."""
    env = {name: values.get(name, value) if isinstance(value, dict) else value
           for name, value in container_env(container).items()}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def _secret_mounts(template: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """secretName -> mount path, for the Secrets ``container`` mounts."""
    volumes = {v["name"]: v["secret"]["secretName"] for v in template["spec"].get("volumes", []) if "secret" in v}
    return {volumes[m["name"]]: m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in volumes}


def _certificate(docs: list[dict[str, Any]], common_name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == "Certificate" and d["spec"].get("commonName") == common_name]
    return found


def _pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        yield from pod_specs(doc)


# --- etcd and the bootstrap Job -----------------------------------------------------------


def test_prod_etcd_accepts_only_client_certificates_of_the_regroup_ca(prod: list[dict[str, Any]]) -> None:
    etcd = one(prod, "StatefulSet", "regroup-etcd")
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    env = container_env(container)
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true"
    assert env["ETCD_LISTEN_CLIENT_URLS"].startswith("https://")
    mounts = _secret_mounts(etcd["spec"]["template"], container)
    server = one(prod, "Certificate", "regroup-etcd-server")
    assert env["ETCD_TRUSTED_CA_FILE"] == f"{mounts[server['spec']['secretName']]}/ca.crt"
    assert server["spec"]["issuerRef"]["name"] == "regroup-etcd-ca"


def _release(image: str) -> tuple[int, ...]:
    return tuple(int(part) for part in image.rsplit(":v", 1)[1].split("."))


def test_every_etcd_of_prod_enforces_read_permissions_on_watches(prod: list[dict[str, Any]]) -> None:
    """Before 3.5.33 (GHSA-xg4h-6gfc-h4m8) a role that may read one key (a job's tombstone,
    its progress) could watch every key after it: every later job's keys and values."""
    images = [c["image"] for _, template in _pod_templates(prod) for c in template["spec"]["containers"]
              if c["image"].startswith("quay.io/coreos/etcd:")]
    assert len(images) == 2  # the members and the defragmentation
    fixed = {(3, 5): (3, 5, 33), (3, 6): (3, 6, 14), (3, 7): (3, 7, 1)}
    for image in images:
        release = _release(image)
        assert release >= fixed.get(release[:2], (3, 8)), image


def test_a_one_shot_job_turns_auth_on_as_root_with_a_certificate_only_it_mounts(prod: list[dict[str, Any]]) -> None:
    job = one(prod, "Job", "regroup-etcd-auth-bootstrap")
    template = job["spec"]["template"]
    (container,) = template["spec"]["containers"]
    args = _expand(container["args"], container, {"POD_NAMESPACE": "regroup-system"})
    assert args[:2] == ["etcd-auth", "bootstrap"]
    parsed = _parse(etcd_auth_command.add_arguments, args[1:])
    # The controller's user is the common name of the certificate the controller presents.
    controller_certificate = one(prod, "Certificate", "regroup-controller-etcd-client")
    assert parsed.controller_user == controller_certificate["spec"]["commonName"] == "regroup-controller"
    assert "--controller-user" in args and "regroup-controller" in args
    # It connects as root, by the root certificate, over TLS to the members' Service.
    root = _certificate(prod, ROOT)
    mounts = _secret_mounts(template, container)
    root_dir = mounts[root["spec"]["secretName"]]
    assert (str(parsed.etcd_cert), str(parsed.etcd_key), str(parsed.etcd_cacert)) == (
        f"{root_dir}/tls.crt", f"{root_dir}/tls.key", f"{root_dir}/ca.crt")
    assert parsed.etcd == "regroup-etcd.regroup-system.svc:2379"
    # The image that has the regroup command, as the controller runs it.
    controller = one(prod, "Deployment", "regroup-controller")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == controller["image"]
    assert template["spec"]["restartPolicy"] in ("OnFailure", "Never") and job["spec"]["backoffLimit"] >= 3
    assert template["spec"]["automountServiceAccountToken"] is False
    # No other pod of the overlay or the examples holds root.
    holders = [
        where for where, other in _pod_templates(prod + _examples())
        for v in other["spec"].get("volumes", [])
        if v.get("secret", {}).get("secretName") == root["spec"]["secretName"]
    ]
    assert holders == [describe(job)]
    # The members' network policy lets it in.
    allowed = one(prod, "NetworkPolicy", "regroup-etcd")["spec"]["ingress"][0]["from"]
    labels = template["metadata"]["labels"]
    assert any(
        "namespaceSelector" not in peer and peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
        for peer in allowed if peer.get("podSelector", {}).get("matchLabels")
    )


def test_every_pod_can_read_the_secret_files_it_mounts(prod: list[dict[str, Any]]) -> None:
    """A Secret volume's files belong to root; a mode without "other" read reaches a
    non-root container only through the pod's fsGroup."""
    checked = 0
    for where, template in _pod_templates(prod + _examples()):
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            if "secret" not in volume:
                continue
            mode = volume["secret"].get("defaultMode", 0o644)
            if mode & 0o004:
                continue
            fs_group = spec.get("securityContext", {}).get("fsGroup")
            assert fs_group is not None and mode & 0o040, f"{where}: volume {volume['name']} is unreadable"
            checked += 1
    assert checked >= 4


# --- the controller -----------------------------------------------------------------------


def test_controller_makes_per_job_identities_and_listens_on_the_pod_ip_only(prod: list[dict[str, Any]]) -> None:
    deployment = one(prod, "Deployment", "regroup-controller")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    env = container_env(container)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    args = _expand(container["args"], container, {"POD_IP": "10.1.2.3", "POD_NAMESPACE": "regroup-system",
                                                  "POD_NAME": "regroup-controller-0"})
    assert args[0] == "controller"
    parsed = _parse(controller_command.add_arguments, args[1:])
    assert parsed.etcd_job_identities is True
    assert parsed.listen_address == "10.1.2.3"
    assert flag_value(container["args"], "listen-address") == "$(POD_IP)"
    # Its identity is the certificate whose CN the bootstrap made a root-role user.
    mounts = _secret_mounts(template, container)
    certificate = one(prod, "Certificate", "regroup-controller-etcd-client")
    assert str(parsed.etcd_cert).startswith(mounts[certificate["spec"]["secretName"]] + "/")
    # The probes reach that listener on the pod IP, by its port name.
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http-metrics"]
    assert parsed.http_port == port
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "http-metrics" and "host" not in container[probe]["httpGet"]


def test_only_prometheus_reaches_the_controller_listener(prod: list[dict[str, Any]]) -> None:
    policy = one(prod, "NetworkPolicy", "regroup-controller")
    labels = one(prod, "Deployment", "regroup-controller")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http-metrics", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}


# --- worker identities --------------------------------------------------------------------


def _example_certificates() -> list[dict[str, Any]]:
    return [d for d in _examples() if d["kind"] == "Certificate"]


def test_example_worker_certificate_names_its_own_job_and_reaches_its_workers() -> None:
    certificates = _example_certificates()
    assert certificates
    for certificate in certificates:
        namespace = certificate["metadata"]["namespace"]
        secret = certificate["spec"]["secretName"]
        users = []
        for doc in _examples():
            if doc["kind"] == "Certificate" or doc["metadata"].get("namespace") != namespace:
                continue
            for where, template in pod_specs(doc):
                (trainer,) = template["spec"]["containers"]
                mounts = _secret_mounts(template, trainer)
                if secret not in mounts:
                    continue
                job = template["metadata"]["labels"]["regroup.dev/job"]
                assert flag_value(trainer["args"], "rdzv-id") == job, where
                # The etcd user the controller makes for this job, and this certificate's CN.
                common_name = certificate["spec"]["commonName"]
                assert common_name == job_user(JobKeys(namespace, job)) == f"regroup:job:{namespace}:{job}"
                # Agent (--rdzv-conf, keys of rendezvous/settings.py) and trainer (--set etcd.*)
                # both present it.
                conf = dict(item.split("=", 1) for item in flag_value(trainer["args"], "rdzv-conf").split(","))
                directory = mounts[secret]
                files = {"cacert": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
                assert conf == {key: f"{directory}/{name}" for key, name in files.items()}
                for key, path in conf.items():
                    assert f"etcd.{key}={path}" in trainer["args"], where
                users.append(where)
        assert len(users) == 1, f"{describe(certificate)}: one job per identity, found {users}"
        assert len(certificate["spec"]["commonName"]) <= 64  # X.509's bound on a common name
        assert certificate["spec"]["usages"] == ["client auth", "digital signature", "key encipherment"]
        assert not {"dnsNames", "ipAddresses", "uris", "emailAddresses", "subject", "isCA"} & set(certificate["spec"])


# --- approver-policy: who may have which name ---------------------------------------------
#
# A model of approver-policy's evaluation (v0.27, cert-manager.io/docs/policy/approval/
# approver-policy): a policy applies to a request when its selector matches the issuer and
# the request's namespace; the request is approved when one applicable policy allows every
# attribute it asks for (wildcard "*" in value(s), every CEL validation true) and holds the
# required ones. The CEL rules are written in the part of CEL that reads the same as Python
# (string concatenation, matches, size, in a list); anything else fails here, loudly.


class _CelString(str):
    def matches(self, pattern: str) -> bool:  # RE2 search, as CEL's matches
        return re.search(pattern, self) is not None

    def size(self) -> int:
        return len(self)

    def startsWith(self, prefix: str) -> bool:  # noqa: N802 (CEL's name)
        return self.startswith(prefix)

    def endsWith(self, suffix: str) -> bool:  # noqa: N802 (CEL's name)
        return self.endswith(suffix)


def _cel(rule: str, value: str, namespace: str) -> bool:
    scope = {"self": _CelString(value), "cr": SimpleNamespace(namespace=namespace, name="request")}
    return bool(eval(rule, {"__builtins__": {}}, scope))  # noqa: S307 (our own manifest, no builtins)


def _wildcard(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]").replace("?", "[?]"))


def _string_field_allows(rules: dict[str, Any] | None, values: list[str], namespace: str) -> bool:
    if not values:
        return not (rules or {}).get("required", False)
    if rules is None:
        return False
    patterns = [rules["value"]] if "value" in rules else rules.get("values")
    validations = rules.get("validations", [])
    if patterns is None and not validations:
        return False
    return all(
        (patterns is None or any(_wildcard(p, v) for p in patterns))
        and all(_cel(check["rule"], v, namespace) for check in validations)
        for v in values
    )


def _selects(policy: dict[str, Any], issuer: dict[str, Any], namespace: str) -> bool:
    selector = policy["spec"]["selector"]
    ref = selector.get("issuerRef")
    if ref is None or any(not _wildcard(ref[k], issuer.get(k, "")) for k in ("name", "kind", "group") if k in ref):
        return False
    names = selector.get("namespace", {}).get("matchNames")
    return names is None or any(_wildcard(n, namespace) for n in names)


def _allows(policy: dict[str, Any], request: dict[str, Any], namespace: str) -> bool:
    allowed = policy["spec"].get("allowed", {})
    strings = {"commonName": [request["commonName"]] if request.get("commonName") else []}
    for field in ("dnsNames", "ipAddresses", "uris", "emailAddresses"):
        strings[field] = request.get(field, [])
    return (
        all(_string_field_allows(allowed.get(field), values, namespace) for field, values in strings.items())
        and set(request.get("usages", [])) <= set(allowed.get("usages", []))
        and (not request.get("isCA") or allowed.get("isCA") is True)
        and "subject" not in request
    )


def _approved(policies: list[dict[str, Any]], request: dict[str, Any], namespace: str) -> bool:
    applicable = [p for p in policies if _selects(p, request["issuerRef"], namespace)]
    return any(_allows(p, request, namespace) for p in applicable)


def _policies(prod: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in prod if d["kind"] == "CertificateRequestPolicy"]


def test_approver_policy_signs_every_certificate_regroup_ships(prod: list[dict[str, Any]]) -> None:
    policies = _policies(prod)
    shipped = [d for d in prod + _example_certificates() if d["kind"] == "Certificate"]
    assert {d["spec"]["issuerRef"]["name"] for d in shipped} == CA_ISSUERS
    for certificate in shipped:
        assert _approved(policies, certificate["spec"], certificate["metadata"]["namespace"]), describe(certificate)


def test_job_identity_policy_names_the_requests_own_namespace(prod: list[dict[str, Any]]) -> None:
    (policy,) = [p for p in _policies(prod) if "namespace" not in p["spec"]["selector"]]
    assert policy["spec"]["selector"]["issuerRef"] == CA_ISSUER
    common_name = policy["spec"]["allowed"]["commonName"]
    assert common_name["required"] is True
    assert any("cr.namespace" in check["rule"] for check in common_name["validations"])


CA_ISSUER = {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "regroup-etcd-ca"}
SELF_SIGNED = {**CA_ISSUER, "name": "regroup-selfsigned"}
WORKER = {"usages": ["client auth", "digital signature", "key encipherment"], "issuerRef": CA_ISSUER}
LLAMA = "regroup:job:ml-team:llama"
CA_REQUEST = {"commonName": "regroup-etcd-ca", "isCA": True, "usages": ["cert sign"], "issuerRef": SELF_SIGNED}

REQUESTS = [
    # (namespace, certificate spec, approved?)
    pytest.param("ml-team", {"commonName": "regroup:job:ml-team:llama"}, True, id="own-namespace"),
    pytest.param("ml-team", {"commonName": "regroup:job:ml-team:llama_v2.1"}, True, id="label-characters"),
    pytest.param("ml-team", {"commonName": "regroup:job:vision:resnet"}, False, id="another-namespace"),
    pytest.param("ml", {"commonName": "regroup:job:ml-team:llama"}, False, id="namespace-prefix"),
    pytest.param("ml-team", {"commonName": "regroup:job:ml-team:llama:x"}, False, id="extra-colon"),
    pytest.param("ml-team", {"commonName": "regroup:job:ml-team:"}, False, id="no-job"),
    pytest.param("ml-team", {"commonName": "regroup:job:ml-team:" + "j" * 45}, False, id="longer-than-64"),
    pytest.param("ml-team", {"commonName": "root"}, False, id="root"),
    pytest.param("ml-team", {"commonName": "regroup-controller"}, False, id="controller"),
    pytest.param("ml-team", {}, False, id="no-common-name"),
    pytest.param("ml-team", {"commonName": LLAMA, "dnsNames": ["regroup-etcd"]}, False, id="extra-san"),
    pytest.param("ml-team", {"commonName": LLAMA, "isCA": True}, False, id="ca"),
    pytest.param("ml-team", {"commonName": LLAMA, "usages": ["server auth"]}, False, id="server-auth"),
    pytest.param("regroup-system", {"commonName": "root"}, True, id="root-in-regroup-system"),
    pytest.param("regroup-system", {"commonName": "regroup-admin"}, False, id="other-name-in-regroup-system"),
    pytest.param("ml-team", {**CA_REQUEST}, False, id="ca-outside-cert-manager"),
    pytest.param("cert-manager", {**CA_REQUEST}, True, id="ca-in-cert-manager"),
]


@pytest.mark.parametrize(("namespace", "spec", "approved"), REQUESTS)
def test_a_namespace_gets_only_its_own_job_identities(
    prod: list[dict[str, Any]], namespace: str, spec: dict[str, Any], approved: bool
) -> None:
    request = {**WORKER, **spec}
    assert _approved(_policies(prod), request, namespace) is approved


def test_the_policies_are_used_by_cert_manager_alone(prod: list[dict[str, Any]]) -> None:
    names = {p["metadata"]["name"] for p in _policies(prod)}
    role = one(prod, "ClusterRole", "regroup-etcd-certificate-policies")
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["policy.cert-manager.io"] and rule["resources"] == ["certificaterequestpolicies"]
    assert rule["verbs"] == ["use"]
    assert set(rule["resourceNames"]) == names
    binding = one(prod, "ClusterRoleBinding", "regroup-etcd-certificate-policies")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cert-manager", "namespace": "cert-manager"}]


def test_a_misspelt_policy_field_is_rejected(prod: list[dict[str, Any]]) -> None:
    policy = copy.deepcopy(next(p for p in _policies(prod) if p["metadata"]["name"] == "regroup-etcd-job-identity"))
    validate_object(policy, K8S_VERSIONS[-1])
    policy["spec"]["allowed"]["commonName"]["validation"] = policy["spec"]["allowed"]["commonName"].pop("validations")
    with pytest.raises(InvalidManifest, match="validation"):
        validate_object(policy, K8S_VERSIONS[-1])
    policy = copy.deepcopy(next(p for p in _policies(prod) if p["metadata"]["name"] == "regroup-etcd-job-identity"))
    policy["metadata"]["namespace"] = "regroup-system"
    with pytest.raises(InvalidManifest, match="cluster-scoped"):
        validate_object(policy, K8S_VERSIONS[-1])


def test_the_guide_no_longer_sets_up_a_shared_worker_identity_by_hand() -> None:
    guide = (REPO / "docs/deploy.md").read_text()
    by_hand = re.findall(r".*\b(?:user add|role add|grant-permission|auth enable)\b.*", guide)
    assert by_hand == [], "etcd auth is set up by the overlay, not by hand"
    assert "regroup-worker --no-password" not in guide
    for heading in ("## etcd auth: one identity per job", "## Threat model"):
        assert heading in guide


# --- the guide's check, against a real etcd with client-certificate auth -------------------


def _issue(tls_dir: Path, name: str, common_name: str) -> tuple[Path, Path]:
    """A client certificate for ``common_name`` from the test CA ``make_tls_files`` made."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tls_dir)

    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={common_name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
    (tls_dir / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "client.ext", "-out", f"{name}.crt")  # fmt: skip
    return tls_dir / f"{name}.crt", tls_dir / f"{name}.key"


async def _status(
    endpoint: str, tls: TlsFiles, cert: tuple[Path, Path] | None, namespace: str, job: str
) -> tuple[int, str]:
    """``regroup status`` as the guide runs it, in its own process."""
    args = [sys.executable, "-m", "regroup.cli", "status", "--json", "--job", job, "--namespace", namespace,
            "--etcd", endpoint]
    if cert is not None:
        args += ["--etcd-cacert", str(tls.ca), "--etcd-cert", str(cert[0]), "--etcd-key", str(cert[1])]
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode()


async def test_a_job_identity_reads_its_own_job_and_is_refused_another(tmp_path: Path) -> None:
    """docs/deploy.md's check: with the worker's certificate, ``regroup status`` shows its
    own job and is refused a neighbour's; without a certificate it gets nothing."""
    tls = make_tls_files(tmp_path / "tls")
    root = _issue(tmp_path / "tls", "root", ROOT)
    ours, theirs = JobKeys("ml-team", "llama-tls"), JobKeys("vision", "resnet")
    worker = _issue(tmp_path / "tls", "worker", job_user(ours))
    progress = Progress(step=42, loss=1.5, samples_seen=0, world_size=16, time=time.time())
    with EtcdServer(data_dir=tmp_path / "etcd", tls=tls) as server:
        as_root = EtcdSettings.from_endpoint_string(server.endpoint, cacert=tls.ca, cert=root[0], key=root[1])
        client = await connect(as_root)
        try:
            await bootstrap(client, "regroup-controller")
            for keys in (ours, theirs):
                await ensure_job_identity(client, keys)
                await client.put(keys.progress.encode(), progress.to_json())
        finally:
            await client.close()
        code, out = await _status(server.endpoint, tls, worker, "ml-team", "llama-tls")
        assert code == 0, out
        assert json.loads(out)["progress"]["step"] == 42
        code, out = await _status(server.endpoint, tls, worker, "vision", "resnet")
        assert code == 1 and "permission denied" in out and job_user(ours) in out, out
        assert "Traceback" not in out, "a refusal is a one-line answer"
        code, out = await _status(server.endpoint, tls, None, "ml-team", "llama-tls")
        assert code == 1 and out.startswith("regroup status: "), out
