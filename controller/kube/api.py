"""Raw JSON requests through kubernetes_asyncio's ApiClient (auth, TLS, kubeconfig).

The controller reads objects as plain JSON, not as generated model classes: it needs a
handful of fields, and decoding 10,000 pods into models costs more than the whole
decision. Watches are read line by line from the response stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config


class KubeError(Exception):
    """The API server answered an error status."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")


async def load_api_client(kubeconfig: Path | None) -> k8s_client.ApiClient:
    """An ApiClient from ``kubeconfig``, or from the in-cluster service account when None."""
    configuration = k8s_client.Configuration()
    if kubeconfig is not None:
        await k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        k8s_config.load_incluster_config(client_configuration=configuration)
    return k8s_client.ApiClient(configuration)


class RawKube:
    """JSON in, JSON out, on one ApiClient."""

    def __init__(self, api_client: k8s_client.ApiClient) -> None:
        self.api_client = api_client

    async def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None,
        body: Any,
        content_type: str,
        timeout: float | aiohttp.ClientTimeout | None,
    ) -> Any:
        params = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in (query or {}).items() if v is not None]
        return await self.api_client.call_api(
            path,
            method,
            query_params=params,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )

    async def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        response = await self._send(method, path, query, body, content_type, timeout)
        try:
            raw = await response.read()
            if not 200 <= response.status <= 299:
                raise KubeError(method, path, response.status, raw.decode(errors="replace"))
            return json.loads(raw) if raw else {}
        finally:
            response.release()

    async def watch(self, path: str, query: Mapping[str, Any], timeout: float) -> AsyncIterator[list[dict[str, Any]]]:
        """Watch events (``{"type", "object"}``) until the server ends the stream, in the
        batches the stream delivers them: everything a read returns, decoded at once (a
        storm's events arrive many to a read, and a step of this iterator per event would
        cost as much as decoding it)."""
        timeouts = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout)
        response = await self._send("GET", path, {**query, "watch": True}, None, "application/json", timeouts)
        try:
            if not 200 <= response.status <= 299:
                raw = await response.read()
                raise KubeError("WATCH", path, response.status, raw.decode(errors="replace"))
            partial = b""
            async for chunk in response.content.iter_any():
                *lines, partial = (partial + chunk).split(b"\n")
                events = [json.loads(line) for line in lines if line.strip()]
                if events:
                    yield events
            if partial.strip():
                yield [json.loads(partial)]
        finally:
            response.release()
