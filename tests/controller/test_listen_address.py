"""``regroup controller --listen-address``: where /metrics, /healthz and /readyz listen."""

from __future__ import annotations

import argparse

import pytest

from regroup.controller import main
from regroup.controller.http import HealthServer
from regroup.controller.metrics import ControllerMetrics


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags_reach_the_settings_and_default_to_todays_behaviour() -> None:
    settings, _ = main.settings_from_args(parse())
    assert settings.runtime.http_host == "0.0.0.0" and not settings.runtime.etcd_job_identities
    settings, _ = main.settings_from_args(parse("--listen-address", "127.0.0.1", "--etcd-job-identities"))
    assert settings.runtime.http_host == "127.0.0.1" and settings.runtime.etcd_job_identities
    assert main.settings_from_args(parse("--listen-address", "[::1]"))[0].runtime.http_host == "::1"
    for bad in ("10.0.0.1:8080", "", "pod ip"):
        with pytest.raises(SystemExit):
            parse("--listen-address", bad)


async def test_the_http_server_listens_on_the_address_given_only() -> None:
    server = HealthServer(ControllerMetrics(), "127.0.0.1", 0, healthy=lambda: True, ready=lambda: True)
    await server.start()
    try:
        assert server._runner is not None
        assert [address[0] for address in server._runner.addresses] == ["127.0.0.1"]
    finally:
        await server.stop()
