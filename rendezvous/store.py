"""``RoundStore``: the agents' c10d store for one round, kept in etcd under ``rdzv/rounds/<n>/``.

torchrun's agents use the store handed out by the rendezvous to share worker ranks,
``MASTER_ADDR``/``MASTER_PORT`` and the exit barrier. Keeping it in etcd, one prefix
per round, means every round starts empty (no dead workers' addresses, no stale
``MASTER_ADDR`` for a node that joins later: pytorch#135712), no agent hosts it (the job
does not die with the agent that would have), and no N-way connection storm hits one
agent at the start of a round. The closer of round N deletes the earlier rounds' keys.

Reads come from the job mirror (``JobWatch``), so a ``get`` that waits for a key costs
no request to etcd; writes return once the mirror has them, so an agent reads its own writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from regroup.etcd import LoopThread
from regroup.rendezvous.connection import JobConnection


EXIT_BARRIER = "torchelastic/agent/terminal_state"
"""Key prefix of torchrun's exit barrier, which an agent enters only once its workers succeeded."""


def round_prefix(rdzv_prefix: str, round: int) -> str:
    """Keys of round ``round``'s store; zero-padded so rounds sort by number."""
    return f"{rdzv_prefix}rounds/{round:010d}/"


class RoundAbandoned(dist.DistStoreError):
    """The round this store belongs to can no longer start (see ``round_abandoned``)."""


class RoundStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in etcd, scoped to one round."""

    def __init__(
        self,
        loop: LoopThread,
        connection: JobConnection,
        prefix: str,
        timeout: timedelta,
        abandoned: Callable[[], str] = lambda: "",
    ) -> None:
        """``abandoned`` says why the round can no longer start ("" while it can); a wait
        for a key then raises ``RoundAbandoned`` at once instead of running out its timeout."""
        super().__init__()
        self._loop = loop
        self._conn = connection
        self._prefix = prefix
        self._abandoned = abandoned
        self.exit_barrier_entered = False
        """This agent entered torchrun's exit barrier: its workers finished successfully."""
        self.set_timeout(timeout)

    # -- c10d Store API (called from torchrun's agent thread) ----------------------------------

    def set(self, key: str, value: Any) -> None:
        self._run(self._put(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        values = self._run(self._wait_for([key], self._wait_s()))
        if values is None:
            raise dist.DistStoreError(f"RoundStore.get({key!r}): no value within {self.timeout}")
        return values[0]

    def add(self, key: str, amount: int) -> int:
        if key.startswith(EXIT_BARRIER):
            self.exit_barrier_entered = True
        return int(self._run(self._add(key, int(amount))))

    def check(self, keys: list[str]) -> bool:
        return bool(self._run(self._check(keys)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._wait_s() if timeout is None else timeout.total_seconds()
        if self._run(self._wait_for(list(keys), seconds), seconds + 10) is None:
            raise dist.DistStoreError(f"RoundStore.wait({list(keys)!r}): keys missing after {seconds}s")

    def delete_key(self, key: str) -> bool:
        return bool(self._run(self._conn.client.delete((self._prefix + key).encode())))

    def num_keys(self) -> int:
        return len(self._conn.watch.store_keys(self._prefix))

    # -- on the loop -------------------------------------------------------------------------

    def _wait_s(self) -> float:
        return self.timeout.total_seconds()

    def _run(self, coro: Any, seconds: float | None = None) -> Any:
        limit = seconds if seconds is not None else self._wait_s() + 10
        return self._loop.run(coro, timedelta(seconds=limit))

    async def _put(self, key: str, value: bytes) -> None:
        response = await self._conn.client.put((self._prefix + key).encode(), value)
        await self._conn.watch.caught_up(int(response.header.revision), 2.0)

    async def _check(self, keys: list[str]) -> bool:
        return all(self._conn.watch.store_value(self._prefix + key) is not None for key in keys)

    async def _wait_for(self, keys: list[str], seconds: float) -> list[bytes] | None:
        watch = self._conn.watch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        full = [self._prefix + k for k in keys]
        while True:
            version = watch.version
            values = [watch.store_value(k) for k in full]
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            reason = self._abandoned()
            if reason:
                raise RoundAbandoned(reason)
            if loop.time() >= deadline:
                return None
            await watch.changed(deadline - loop.time(), since=version)

    async def _add(self, key: str, amount: int) -> int:
        client = self._conn.client
        tx = client.transactions
        full = (self._prefix + key).encode()
        while True:
            current = await client.get(full)
            value = int(current.value) + amount if current is not None else amount
            revision = current.mod_revision if current is not None else 0
            ok, _ = await client.transaction(
                compare=[tx.mod(full) == revision], success=[tx.put(full, str(value).encode())], failure=[]
            )
            if ok:
                return value


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
