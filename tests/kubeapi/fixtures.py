"""pytest fixtures for the Kubernetes API stand-in: the server, its kubeconfig, a connected client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client, config

from kubeapi.server import FakeKubeAPI


@pytest.fixture
async def kube_api() -> AsyncIterator[FakeKubeAPI]:
    """A started FakeKubeAPI on 127.0.0.1, stopped after the test."""
    api = FakeKubeAPI()
    await api.start()
    try:
        yield api
    finally:
        await api.stop()
    assert not api.internal_errors, "the Kubernetes API stand-in failed:\n" + "\n".join(api.internal_errors)


@pytest.fixture
def kubeconfig(kube_api: FakeKubeAPI, tmp_path: Path) -> Path:
    """A kubeconfig file pointing at `kube_api`."""
    return kube_api.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def kube_client(kubeconfig: Path) -> AsyncIterator[client.ApiClient]:
    """A kubernetes_asyncio ApiClient loaded from `kubeconfig`, closed after the test."""
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    api_client = client.ApiClient(configuration)
    try:
        yield api_client
    finally:
        await api_client.close()
