"""``bench platform --auth``: the command line, the certificates and settings that put each
process of an auth-on platform under its own etcd identity, the gateway on such an etcd, and
the per-job table that sets auth off and on side by side (no platform is run here)."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.platform.agent_specs import JobPlacement, Timing
from bench.platform.cli import modes, parse
from bench.platform.etcd_auth import CONTROLLER_USER, OBSERVER, PlatformAuth, bootstrap
from bench.platform.leftovers import job_identities_left
from bench.platform.observe import COUNTERS, GAUGES, EtcdGateway
from bench.platform.probe import KINDS
from bench.platform.rank_zero import RankZero
from bench.platform.report import per_job, render
from regroup.demo.etcd_server import EtcdServer, issue_client_certificate
from regroup.etcd import EtcdSettings, connect
from regroup.etcd.auth import ensure_job_identity, job_user, remove_job_identity
from regroup.etcd.settings import certificate_cn
from regroup.keys import JobKeys
from regroup.rendezvous.settings import parse_settings


def test_auth_runs_both_modes_by_default_off_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse([]).auth == "both" and modes("both") == ["off", "on"]
    quick = parse(["--quick", "--auth", "on"])
    assert (quick.auth, quick.jobs, quick.agents) == ("on", [2], 4) and modes(quick.auth) == ["on"]
    assert modes(parse(["--auth", "off"]).auth) == ["off"]
    with pytest.raises(SystemExit) as refused:
        parse(["--auth", "maybe"])
    assert refused.value.code == 2 and "--auth" in capsys.readouterr().err


def _verifies(ca: Path, cert: Path) -> bool:
    run = subprocess.run(["openssl", "verify", "-CAfile", str(ca), str(cert)], capture_output=True, text=True)
    return run.returncode == 0


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> PlatformAuth:
    return PlatformAuth.make(tmp_path_factory.mktemp("pki"))


def test_every_client_certificate_names_its_etcd_user(auth: PlatformAuth) -> None:
    ca = auth.tls.ca
    controller = auth.controller_flags()
    assert "--etcd-job-identities" in controller
    assert certificate_cn(Path(controller[controller.index("--etcd-cert") + 1])) == CONTROLLER_USER
    job = auth.job("bench", "job-0001")
    assert certificate_cn(Path(job.cert)) == "regroup:job:bench:job-0001" == job_user(JobKeys("bench", "job-0001"))
    # The gateway refuses a certificate with a CN when etcd checks client certificates.
    access = auth.gateway_access()
    assert certificate_cn(access.cert) is None and access.user == OBSERVER
    for cert in (Path(job.cert), access.cert, auth.tls.server_cert):
        assert _verifies(ca, cert), cert
    # Issued once per CN; CNs that differ only where a file name cannot follow get files of their own.
    assert issue_client_certificate(ca, "regroup:job:bench:job-0001") == (Path(job.cert), Path(job.key))
    assert issue_client_certificate(ca, "regroup_job_bench_job-0001")[0] != Path(job.cert)


def test_a_jobs_agents_and_rank_zero_present_the_jobs_certificate(auth: PlatformAuth) -> None:
    tls = auth.job("bench", "job-0002")
    placement = JobPlacement("bench", "job-0002", 2, 4, (("n0", "job-0002-n0"),), tls)
    conf = placement.rdzv_conf(Timing())
    assert conf["lease_ttl"] == "5" and (conf["cacert"], conf["cert"], conf["key"]) == (tls.cacert, tls.cert, tls.key)
    settings = parse_settings(endpoint="127.0.0.1:2379", run_id="job-0002", min_nodes=2, max_nodes=4, conf=conf,
                              env={"NODE_NAME": "n0", "POD_NAMESPACE": "bench"}, local_addr="127.0.0.1")  # fmt: skip
    assert settings.etcd.identity == "regroup:job:bench:job-0002"
    rank_zero = RankZero("127.0.0.1:2379", "bench", "job-0002", timedelta(seconds=0.5), timedelta(seconds=5),
                         on_resumed=lambda _: None, tls=tls)  # fmt: skip
    try:
        cfg = rank_zero.channel.cfg
        assert (cfg.cacert, cfg.cert, cfg.key) == (tls.cacert, tls.cert, tls.key)
    finally:
        rank_zero.channel.close()
    assert "cert" not in JobPlacement("bench", "job-0002", 2, 4, ()).rdzv_conf(Timing())


async def test_the_gateway_reads_an_auth_etcd_by_token_and_sees_job_identities(tmp_path: Path) -> None:
    auth = PlatformAuth.make(tmp_path / "pki")
    with EtcdServer(data_dir=tmp_path / "etcd", tls=auth.tls) as etcd:
        gateway = EtcdGateway(etcd.url, auth.gateway_access())
        said = await bootstrap(etcd, auth, gateway, tmp_path / "bootstrap.log")
        assert "authentication enabled" in said
        assert {"root", CONTROLLER_USER, OBSERVER} <= set(gateway.users())
        assert gateway.count("/regroup/") == 0 and gateway.leases() == 0
        cert, key = auth.tls.client_for(CONTROLLER_USER)
        client = await connect(EtcdSettings.from_endpoint_string(etcd.endpoint, cacert=auth.tls.ca, cert=cert, key=key))
        try:
            keys = JobKeys("bench", "job-0001")
            await ensure_job_identity(client, keys)
            user = job_user(keys)
            assert job_identities_left(gateway, "bench", ["job-0001"]) == {"users": [user], "roles": [user]}
            assert job_identities_left(gateway, "bench", ["job-0002"]) == {"users": [], "roles": []}
            gateway._token = "expired"  # etcd answers 401: the gateway logs in again
            await remove_job_identity(client, keys)
            assert job_identities_left(gateway, "bench", ["job-0001"]) == {"users": [], "roles": []}
        finally:
            await client.close()


def _size(jobs: int, auth: str, etcd_cores: float, controller_cores: float) -> dict[str, Any]:
    """A size's results with what ``render`` reads, every rate 1/s."""
    usage = {"rss_mb": 50.0, "peak_rss_mb": 60.0, "count": 1}
    probe = {"n": 1, "failed": 0, "p50_s": 0.5, "p99_s": 0.6, "max_s": 0.6}
    identities = {"users": [], "roles": []} if auth == "on" else None
    return {
        "jobs": jobs, "auth": auth, "agents_per_job": 4, "window_s": 60.0, "load_before": 0.5, "leases": 5,
        "rates": dict.fromkeys(COUNTERS, 1.0), "gauges": dict.fromkeys(GAUGES, 1.0), "grpc_per_s": {"Put": 1.0},
        "processes": {"etcd": {**usage, "cpu_cores": etcd_cores},
                      "controller": {**usage, "cpu_cores": controller_cores},
                      **{name: {**usage, "cpu_cores": 0.01} for name in ("agent_hosts", "probe_host", "bench")}},
        "probe": dict.fromkeys(KINDS, probe), "profiles": {}, "errors": [],
        "end": {"ended_jobs": jobs + 1, "jobs_with_keys": 0, "keys_left": 0, "key_kinds": {}, "tombstones": 0,
                "leases_start": 1, "leases_end": 1, "identities_left": identities, "retention_s": 10.0,
                "db_bytes_before": 2**20, "db_bytes_after": 0},
    }  # fmt: skip


def test_the_per_job_table_sets_auth_off_and_on_side_by_side() -> None:
    sizes = [_size(0, "off", 0.020, 0.010), _size(0, "on", 0.025, 0.012),
             _size(10, "off", 0.060, 0.020), _size(10, "on", 0.105, 0.032)]  # fmt: skip
    run = {"machine": "test", "cpus": 2, "etcd_version": "3.4", "agents_per_job": 4, "churn_per_job_min": 0.5,
           "probe_cycles": 1, "join_window_s": 2.0, "step_time_s": 0.5, "progress_interval_s": 5.0, "lease_ttl_s": 5.0,
           "auth": "both", "py_spy": False, "sizes": sizes, "failed": []}  # fmt: skip
    costs = per_job(sizes)
    assert costs[(10, "off")]["etcd CPU ms/s"] == pytest.approx(4.0)
    assert costs[(10, "on")]["etcd CPU ms/s"] == pytest.approx(8.0)
    text = render(run)
    # etcd 4.00 off, 8.00 on: 2.00×; controller 1.00 off, 2.00 on: 2.00×; rates equal off and on.
    assert "| 10 | 4.00 | 8.00 | 2.00× | 1.00 | 2.00 | 2.00× | 0.00 / 0.00 |" in text
    assert "Where it bends, auth off" in text and "Where it bends, auth on" in text
    assert "| 10 | on | 11 | 0 | 0 | none | 0 | 1 → 1 | 0 / 0 | 10 s |" in text
    assert "| 10 | off | 11 | 0 | 0 | none | 0 | 1 → 1 | - | 10 s |" in text
