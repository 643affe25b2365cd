"""N rendezvous agents of one backend, as threads of this process driving real handlers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from regroup.etcd import EtcdSettings, connect
from regroup.keys import JobKeys
from regroup.records import ExpectedMembership, ReformCause, ReformRequest
from regroup.rendezvous.connection import Shared
from regroup.rendezvous.handler import EtcdV3RendezvousHandler
from regroup.rendezvous.settings import parse_settings


@dataclass
class Result:
    backend: str
    n: int
    scenario: str
    seconds: float | None
    note: str = ""


class Fleet:
    """N agents of one backend, as threads driving real handlers."""

    def __init__(
        self,
        backend: str,
        n: int,
        run_id: str,
        endpoints: dict[str, str],
        nnodes: tuple[int, int],
        fast: bool,
        conf: Mapping[str, str] | None = None,
        identities: Sequence[Mapping[str, str]] | None = None,
    ) -> None:
        """``conf``: rendezvous options that override the defaults below (any backend).
        ``identities``: each etcd-v3 agent's downward-API environment (``NODE_NAME``, and
        ``POD_NAME``, ``POD_NAMESPACE`` to tie it to a pod); default: nodes ``node000``... of
        namespace ``default``."""
        self.backend = backend
        self.run_id = run_id
        self.endpoint = endpoints[backend]
        self.pool = ThreadPoolExecutor(max_workers=n)
        self.shared: Shared | None = None
        envs = list(identities) if identities is not None else [{"NODE_NAME": f"node{i:03d}"} for i in range(n)]
        self.nodes = [env["NODE_NAME"] for env in envs]
        self._conf = dict(conf or {})
        self._nnodes = nnodes
        self._fast = fast
        self.handlers = [self._make(env) for env in envs]
        self.ranks: dict[int, int] = {}

    def add(self, identity: Mapping[str, str]) -> int:
        """One more etcd-v3 agent (a node joining the job); returns its index."""
        self.nodes.append(identity["NODE_NAME"])
        self.handlers.append(self._make(identity))
        return len(self.handlers) - 1

    def _make(self, env: Mapping[str, str]) -> Any:
        nnodes, fast = self._nnodes, self._fast
        if self.backend == "etcd-v3":
            # A first round of N agents must not close before all have joined (a slow machine can
            # take longer than the 5 s default); 30 s is torch's default last call.
            conf = {"join_timeout": "300", "last_call_timeout": "30"}
            if fast:
                conf |= {"lease_ttl": "2", "last_call_timeout": "0.5"}
            conf |= self._conf
            settings = parse_settings(
                endpoint=self.endpoint, run_id=self.run_id, min_nodes=nnodes[0], max_nodes=nnodes[1],
                conf=conf, env=env, local_addr="127.0.0.1",
            )  # fmt: skip
            if self.shared is None:
                self.shared = Shared.open(settings)
            return EtcdV3RendezvousHandler(settings, shared=self.shared)
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        conf: dict[str, Any] = {"join_timeout": "300"}
        if fast:
            conf |= {"last_call_timeout": "2", "keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
        conf |= self._conf
        if self.backend == "c10d":
            conf["is_host"] = False
        params = RendezvousParameters(
            backend=self.backend, endpoint=self.endpoint, run_id=self.run_id,
            min_nodes=nnodes[0], max_nodes=nnodes[1], local_addr="127.0.0.1", **conf,
        )  # fmt: skip
        return get_rendezvous_handler(params)

    def rendezvous(self, indices: list[int], limit: float) -> tuple[float | None, str]:
        """All ``indices`` call ``next_rendezvous`` at once; seconds until the last returns."""
        started = time.monotonic()
        futures = {self.pool.submit(self.handlers[i].next_rendezvous): i for i in indices}
        done, pending = wait(futures, timeout=limit)
        elapsed = time.monotonic() - started
        if pending:
            return None, f"> {limit:.0f}s ({len(pending)} of {len(indices)} not done)"
        sizes = set()
        for future in done:
            info = future.result()
            sizes.add(info.world_size)
            self.ranks[futures[future]] = info.rank
        if sizes != {len(indices)}:
            return elapsed, f"world sizes {sorted(sizes)}"
        return elapsed, ""

    def victim(self) -> int:
        """The highest rank: killing the agent that hosts the round's store is another story."""
        return max(self.ranks, key=lambda i: self.ranks[i])

    def kill(self, i: int) -> None:
        handler = self.handlers[i]
        if self.backend == "etcd-v3":
            keys = handler._keys
            keeper, keys._keeper = keys._keeper, None
            handler._shared.loop.run(keeper.stop(revoke=False))
            handler._shut = True
        else:
            handler._stop_heartbeats()

    def leave(self, i: int) -> None:
        if self.backend == "etcd-v3":
            self.handlers[i].shutdown()
        else:
            self.kill(i)

    def close(self) -> None:
        for handler in self.handlers:
            try:
                if self.backend == "etcd-v3":
                    handler.shutdown()
                else:
                    handler._stop_heartbeats()
            except Exception as exc:  # noqa: BLE001 - best effort teardown of a benchmark fleet
                print(f"  teardown of a {self.backend} agent failed: {exc}", flush=True)
        if self.shared is not None:
            self.shared.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def write_lever(endpoint: str, job: str, nodes: list[str], generation: int) -> None:
    keys = JobKeys("default", job)

    async def write() -> None:
        client = await connect(EtcdSettings.from_endpoint_string(endpoint))
        try:
            await client.put(keys.expected.encode(), ExpectedMembership(generation=generation, nodes=nodes).to_json())
            request = ReformRequest(generation=generation, cause=ReformCause.NODE_LOST.value)
            await client.put(keys.reform.encode(), request.to_json())
        finally:
            await client.close()

    asyncio.run(write())
