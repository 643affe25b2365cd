"""FakeKubeAPI: an HTTP Kubernetes API server on 127.0.0.1 for the real kubernetes_asyncio client.

Tests and the server share one event loop: a test arranges the cluster through the
in-process methods (`create`, `patch`, `delete`, ...), injects faults (`drop_watches`,
`compact`, `fail_next`), and awaits what the client did (`wait_for`, `requests`, `events`).
docs/testing-kubeapi.md says what is faithful and what is left out.
"""

from __future__ import annotations

import asyncio
import builtins
import secrets
import ssl
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import yaml
from aiohttp import web

from kubeapi import discovery, resources
from kubeapi.errors import ApiError, bad_request
from kubeapi.jsontree import clone
from kubeapi.listing import list_collection
from kubeapi.params import parse_bool, selection
from kubeapi.registry import PATCH_TYPES, WHOLE_OBJECT, DeleteOptions, Registry
from kubeapi.resources import Resource
from kubeapi.selectors import (
    parse_label_selector,
)
from kubeapi.store import Key, Store
from kubeapi import routes
from kubeapi.faults import FailureRules
from kubeapi.routes import Route, json_response, read_body
from kubeapi.watching import serve_watch



class ServerCertificate(Protocol):
    """Where the files of an HTTPS server certificate are (``regroup.demo.etcd_server.TlsFiles`` is one)."""

    @property
    def ca(self) -> Path: ...
    @property
    def server_cert(self) -> Path: ...
    @property
    def server_key(self) -> Path: ...

class RecordedRequest(NamedTuple):
    """One HTTP request as the server received it."""

    method: str
    path: str
    query: dict[str, str]


class FakeKubeAPI:
    """A Kubernetes API server stand-in: nodes, pods, events, leases, namespaces and
    PodDisruptionBudgets over HTTP."""

    def __init__(
        self,
        *,
        bookmark_interval: timedelta = timedelta(seconds=0.5),
        history_limit: int = 100_000,
        graceful_pod_deletion: bool = False,
        too_large_rv_wait: timedelta = timedelta(seconds=3),
        seed: int = 0,
        clock: Callable[[], datetime] | None = None,
        tls: ServerCertificate | None = None,
    ) -> None:
        """
        bookmark_interval: how often a watch with allowWatchBookmarks gets a BOOKMARK (the
            real server: about a minute; short here so tests see them).
        history_limit: changes kept for watches to resume from; older ones answer 410.
        graceful_pod_deletion: see Registry.graceful_pod_deletion.
        too_large_rv_wait: how long a read from a future resourceVersion waits before 504.
        seed: seeds uids and generated names, so runs are reproducible.
        clock: the time stamped into objects (UTC); defaults to the wall clock.
        tls: serve HTTPS with this server certificate (demo.etcd_server.make_tls_files);
            the kubeconfig then names the CA. kubectl sends its token only over HTTPS.
        """
        if bookmark_interval <= timedelta(0):
            raise ValueError(f"bookmark_interval: must be positive, got {bookmark_interval}")
        self.bookmark_interval = bookmark_interval
        self.too_large_rv_wait = too_large_rv_wait
        self.token = secrets.token_hex(16)
        """Bearer token the server requires; the kubeconfig carries it."""
        self.requests: list[RecordedRequest] = []
        """Every HTTP request received, in order."""
        self.internal_errors: list[str] = []
        """Tracebacks of requests the stand-in itself failed on; the kube_api fixture fails the test on any."""
        self._waiters: set[asyncio.Future[None]] = set()
        self._failures = FailureRules()
        self._store = Store(history_limit=history_limit, on_change=self._notify)
        self._registry = Registry(
            self._store,
            clock=clock or (lambda: datetime.now(UTC)),
            seed=seed,
            graceful_pod_deletion=graceful_pod_deletion,
        )
        for namespace in ("default", "kube-node-lease", "kube-public", "kube-system"):
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        self._tls = tls
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Listens on a free 127.0.0.1 port."""
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        ssl_context = None
        if self._tls is not None:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self._tls.server_cert, self._tls.server_key)
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        self._port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Cuts every watch and stops listening."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        """http(s)://127.0.0.1:PORT, once started."""
        if self._port is None:
            raise RuntimeError("FakeKubeAPI.url: the server is not started")
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self._port}"

    def write_kubeconfig(self, path: Path | str) -> Path:
        """Writes a kubeconfig (server URL, bearer token, CA when TLS) that load_kube_config accepts."""
        path = Path(path)
        cluster: dict[str, str] = {"server": self.url}
        if self._tls is not None:
            cluster["certificate-authority"] = str(self._tls.ca)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kubeapi", "cluster": cluster}],
            "users": [{"name": "tests", "user": {"token": self.token}}],
            "contexts": [{"name": "kubeapi", "context": {"cluster": "kubeapi", "user": "tests"}}],
            "current-context": "kubeapi",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # --- the cluster, in process ------------------------------------------------------

    @property
    def graceful_pod_deletion(self) -> bool:
        """Whether an HTTP delete of a running pod only marks it, leaving `delete` to the test."""
        return self._registry.graceful_pod_deletion

    @graceful_pod_deletion.setter
    def graceful_pod_deletion(self, value: bool) -> None:
        self._registry.graceful_pod_deletion = value

    @property
    def resource_version(self) -> int:
        """The newest revision written."""
        return self._store.revision

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Creates an object as a test sets it up: status is kept, a missing namespace is made."""
        resource = resources.by_api_version_kind(obj.get("apiVersion", ""), obj.get("kind", ""))
        namespace = (obj.get("metadata") or {}).get("namespace") or "default"
        stored = self._registry.create(resource, obj, namespace, from_client=False)
        return clone(resource.wire(stored))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object (a copy), or None; `kind` is a kind or plural ("Node", "pods")."""
        resource = resources.by_name(kind)
        obj = self._store.get(resource.storage, self._key(resource, name, namespace))
        return clone(obj) if obj is not None else None

    def patch(
        self, kind: str, name: str, patch: Any, namespace: str | None = None, patch_type: str = "merge"
    ) -> dict[str, Any]:
        """Patches the whole object, status included (the test plays kubelet and controllers)."""
        resource = resources.by_name(kind)
        ns, name = self._key(resource, name, namespace)
        return clone(self._registry.patch(resource, ns, name, clone(patch), patch_type, subresource=WHOLE_OBJECT))

    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        """Deletes at once (the kubelet's final delete); objects with finalizers wait for them."""
        resource = resources.by_name(kind)
        ns, name = self._key(resource, name, namespace)
        self._registry.delete(resource, ns, name, DeleteOptions(), from_client=False)

    def list(self, kind: str, namespace: str | None = None, label_selector: str | None = None) -> list[dict[str, Any]]:
        """Copies of the objects of `kind`, by namespace and name, optionally filtered."""
        resource = resources.by_name(kind)
        labels = parse_label_selector(label_selector)
        return [
            clone(obj)
            for key, obj in sorted(self._store.items(resource.storage).items())
            if (namespace is None or key[0] == namespace) and labels.matches(obj["metadata"].get("labels"))
        ]

    def events(self, namespace: str | None = None) -> builtins.list[dict[str, Any]]:
        """core/v1 Events posted (by any client), oldest first."""
        return sorted(self.list("Event", namespace), key=lambda e: int(e["metadata"]["resourceVersion"]))

    def block_eviction(self, namespace: str, name: str, budget: str = "pdb") -> None:
        """Evicting this pod answers 429 as if the PodDisruptionBudget `budget` had no room,
        whatever PodDisruptionBudget objects say (a pod not running, or already terminating,
        may still be evicted)."""
        self._registry.eviction_blocks[(namespace, name)] = budget

    def unblock_eviction(self, namespace: str, name: str) -> None:
        """Lets this pod be evicted again."""
        self._registry.eviction_blocks.pop((namespace, name), None)

    def open_watches(self, kind: str | None = None) -> int:
        """How many watch streams are open (on `kind`'s storage, or all)."""
        storage = resources.by_name(kind).storage if kind else None
        return sum(1 for w in self._store.watchers if storage is None or w.filter.resource.storage == storage)

    # --- faults ------------------------------------------------------------------------

    def drop_watches(self) -> None:
        """Cuts every open watch connection mid-stream, as a crashed server or proxy would."""
        self._close_watches("drop")

    def end_watches(self) -> None:
        """Ends every open watch cleanly, as the server does when a watch times out."""
        self._close_watches("end")

    def compact(self) -> None:
        """Forgets history: watches and exact reads from any older resourceVersion get 410 Gone."""
        self._store.compact()

    def fail_next(
        self, method: str, path_regex: str, status: int, times: int = 1, *, watch: bool | None = None
    ) -> None:
        """The next `times` requests whose method matches (or "*") and whose path matches
        `path_regex` (re.search) answer `status` with a Status body. `watch`: only watch
        requests (True), only non-watch requests (False), or both (None)."""
        self._failures.add(method, path_regex, status, times, watch)

    # --- waiting -----------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[FakeKubeAPI], Any], timeout: float | timedelta = 10.0) -> Any:
        """Awaits until predicate(self) is truthy, re-checked on every write, request and
        watch change; returns its value. Raises TimeoutError naming the last requests."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(seconds):
                while not (result := predicate(self)):
                    waiter = loop.create_future()
                    self._waiters.add(waiter)
                    try:
                        await waiter
                    finally:
                        self._waiters.discard(waiter)
        except TimeoutError:
            recent = "\n  ".join(f"{r.method} {r.path} {r.query}" for r in self.requests[-10:])
            raise TimeoutError(
                f"wait_for: predicate still false after {seconds}s; last requests:\n  {recent}"
            ) from None
        return result

    def _notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _await_revision(self, rv: int) -> None:
        if rv <= self._store.revision:
            return
        try:
            await self.wait_for(lambda api: api.resource_version >= rv, self.too_large_rv_wait)
        except TimeoutError:
            raise ApiError(
                504,
                f"Too large resource version: {rv}, current: {self._store.revision}",
                details={
                    "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                    "retryAfterSeconds": 1,
                },
            ) from None

    # --- HTTP --------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(RecordedRequest(request.method, request.path, query))
        self._notify()
        try:
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                raise ApiError(401, "Unauthorized")
            is_watch = parse_bool(query.get("watch"), "watch")
            self._failures.check(request.method, request.path, is_watch)
            if request.path in ("/healthz", "/livez", "/readyz"):
                return web.Response(text="ok")
            if request.path in ("/version", "/version/"):
                return json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"})
            if request.method == "GET" and (found := discovery.document(request.path, f"127.0.0.1:{self._port}")):
                return json_response(found)
            route = routes.resolve(request.path)
            return await self._dispatch(request, route, query, is_watch)
        except ApiError as e:
            return json_response(e.status(), e.code)
        except Exception as e:
            # A bug in the stand-in, not in the client: answered 500 and kept for the fixture to report.
            self.internal_errors.append(f"{request.method} {request.path}: {traceback.format_exc()}")
            return json_response(ApiError(500, f"internal error: {e!r}").status(), 500)

    async def _dispatch(
        self, request: web.Request, route: Route, query: dict[str, str], is_watch: bool
    ) -> web.StreamResponse:
        resource, method = route.resource, request.method
        if "dryRun" in query:
            raise bad_request("dryRun: not supported by this API server")
        namespace = route.namespace or ""
        if route.name is None:
            if method == "GET" and is_watch:
                return await serve_watch(
                    request,
                    self._store,
                    selection(resource, route.namespace, query),
                    query,
                    bookmark_interval=self.bookmark_interval,
                    await_revision=self._await_revision,
                    notify=self._notify,
                    internal_errors=self.internal_errors,
                )
            if method == "GET":
                selected = selection(resource, route.namespace, query)
                return json_response(await list_collection(self._store, selected, query, self._await_revision))
            if method == "POST" and (route.namespace is not None or not resource.namespaced):
                stored = self._registry.create(resource, await read_body(request), namespace, from_client=True)
                return json_response(resource.wire(stored), 201)
            raise ApiError(405, f"the server does not allow this method on the requested resource: {method}")
        if route.subresource == "eviction":
            if method != "POST":
                raise ApiError(405, f"the server does not allow this method on the requested resource: {method}")
            self._registry.evict(namespace, route.name, await read_body(request))
            return json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        if method == "GET":
            return json_response(resource.wire(self._registry.get(resource, namespace, route.name)))
        if method == "PUT":
            stored, created = self._registry.replace(
                resource, namespace, route.name, await read_body(request), subresource=route.subresource
            )
            return json_response(resource.wire(stored), 201 if created else 200)
        if method == "PATCH":
            patch_type = PATCH_TYPES.get(request.content_type)
            if patch_type is None:
                raise ApiError(
                    415,
                    f"the body of the request was in an unknown format ({request.content_type}) - accepted media "
                    "types include: " + ", ".join(PATCH_TYPES),
                )
            stored = self._registry.patch(
                resource, namespace, route.name, await read_body(request), patch_type, subresource=route.subresource
            )
            return json_response(resource.wire(stored))
        if method == "DELETE" and route.subresource is None:
            body = await read_body(request) if request.can_read_body else None
            options = DeleteOptions.parse(body, query.get("gracePeriodSeconds"))
            stored = self._registry.delete(resource, namespace, route.name, options, from_client=True)
            return json_response(resource.wire(stored))
        raise ApiError(405, f"the server does not allow this method on the requested resource: {method}")

    def _close_watches(self, how: str) -> None:
        for watcher in list(self._store.watchers):
            watcher.close(how)
        self._store.watchers.clear()
        self._notify()

    @staticmethod
    def _key(resource: Resource, name: str, namespace: str | None) -> Key:
        if resource.namespaced:
            if not namespace:
                raise ValueError(f"namespace: required for {resource.kind} {name!r}")
            return namespace, name
        if namespace:
            raise ValueError(f"namespace: {resource.kind} is cluster-scoped, got namespace {namespace!r}")
        return "", name
