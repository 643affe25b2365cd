"""``/metrics``, ``/healthz`` and ``/readyz`` on one aiohttp server in the controller's loop."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from regroup.controller.metrics import ControllerMetrics


class HealthServer:
    """Serves the metrics registry and the two probes until ``stop``."""

    def __init__(
        self, metrics: ControllerMetrics, host: str, port: int, healthy: Callable[[], bool], ready: Callable[[], bool]
    ) -> None:
        self._metrics = metrics
        self._host = host
        self._port = port
        self._healthy = healthy
        self._ready = ready
        self._runner: web.AppRunner | None = None
        self.port = port

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/healthz", self._probe(self._healthy))
        app.router.add_get("/readyz", self._probe(self._ready))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        sockets = getattr(site, "_server", None)
        if sockets is not None and sockets.sockets:
            self.port = sockets.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _serve_metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    def _probe(check: Callable[[], bool]):
        async def handler(_: web.Request) -> web.Response:
            ok = check()
            return web.Response(status=200 if ok else 503, text="ok\n" if ok else "not ready\n")

        return handler
