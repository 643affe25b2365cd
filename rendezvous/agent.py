"""The writes of one agent: its leased member key, join records, round closes.

Every key an agent writes is bound to its lease, so a dead agent leaves nothing behind
within the lease TTL. If etcd lost the lease (etcd was down longer than the TTL), the
agent grants a new one and writes its keys again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous import RendezvousError

from regroup import etcd
from regroup.records import JoinRecord, MemberRecord, RoundState, agent_id
from regroup.rendezvous.connection import JobConnection
from regroup.rendezvous.decisions import JobView, Me
from regroup.rendezvous.join_steps import CloseRound
from regroup.rendezvous.settings import RendezvousSettings
from regroup.rendezvous.silent import HURRY_EVERY, HURRY_FOR, find_silent
from regroup.rendezvous.store import round_prefix
from regroup.rendezvous.watch import JobWatch

log = structlog.get_logger("regroup.rendezvous.agent")


class DuplicateNode(RendezvousError):
    """Another live agent runs under this agent's node name."""


class AgentKeys:
    """Registers one agent in etcd and applies the handler's decisions."""

    def __init__(self, connection: JobConnection, settings: RendezvousSettings) -> None:
        self._conn = connection
        self._settings = settings
        keys = settings.job
        self._member_key = keys.member(settings.identity.node).encode()
        self._join_key = f"{keys.rdzv}joins/{settings.identity.node}".encode()
        self._state_key = f"{keys.rdzv}state".encode()
        self._rounds_key = f"{keys.rdzv}rounds/".encode()
        self._keeper: etcd.LeaseKeeper | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._member_update: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._hurried_for = 0.0
        """``peer_failure_at`` of the newest failure of its round this agent renewed for."""
        self._unlisten: Callable[[], None] | None = None
        self._leased: dict[bytes, bytes] = {}
        ident = settings.identity
        self.member = MemberRecord(
            node=ident.node,
            pod=ident.pod,
            namespace=ident.namespace,
            round=0,
            local_world_size=ident.local_world_size,
            host=ident.host,
            joined_at=time.time(),
        )
        self.me = Me(node=ident.node, agent=agent_id(self.member), host=ident.host)
        self.not_before = 0.0
        """Probation: join records ask the round not to count this agent before this time."""
        self.warming_since = 0.0
        """When this agent began starting its workers ahead of its next join (0: not now)."""

    @property
    def registered(self) -> bool:
        return self._keeper is not None

    @property
    def client(self) -> Any:
        return self._conn.client

    async def register(self, join_round: int) -> int:
        """Grant the lease, start its keep-alive, and write the member key and a join record
        for ``join_round`` in one transaction; returns the revision."""
        keeper = self._new_keeper()
        await keeper.start()
        keys = {self._member_key: self.member.to_json(), self._join_key: self._join_record(join_round)}
        tx = self.client.transactions
        try:
            await self.client.transaction(
                compare=[], success=[tx.put(key, value, lease=keeper.lease) for key, value in keys.items()], failure=[]
            )
        except BaseException:
            await keeper.stop(revoke=True)
            raise
        self._keeper = keeper
        self._leased.update(keys)
        if self._unlisten is None:
            self._unlisten = self._conn.watch.listen(self._on_view)
        return await self._revision()

    def update_member_soon(self, round: int, restart_count: int) -> None:
        """Record the agent's round, restart count and probation in its member key, off the
        critical path."""
        self._member_changed(
            dataclasses.replace(
                self.member, round=round, restart_count=restart_count, not_before=self.not_before,
                warming_since=self.warming_since,
            )
        )  # fmt: skip

    def note_leaving_soon(self, since: float, by: float) -> None:
        """Record in the member key that this agent was told to stop at ``since`` and must be
        gone by ``by`` (unix times): the controller's cue for a planned leave."""
        self._member_changed(dataclasses.replace(self.member, leaving_since=since, leaving_by=by))

    def note_peer_failure_soon(self, round: int, at: float, peer: str, probe: list[str]) -> None:
        """Record in the member key that a worker's collective of ``round`` failed on a
        peer at ``at`` (naming ``peer``, a host, or ""): the controller's first evidence.
        Then watch the leases of the round's members ``probe`` and name those found dead
        (``regroup.rendezvous.silent``)."""
        self._member_changed(
            dataclasses.replace(
                self.member, peer_failure_round=round, peer_failure_at=at, failed_peer=peer, silent_peers=[]
            )
        )
        if self._probe is not None:
            self._probe.cancel()  # an earlier round's: its names no longer count
        self._probe = None
        if probe:
            self._probe = asyncio.create_task(self._find_silent(round, at, probe), name=f"rdzv-probe-{self.me.node}")

    async def _find_silent(self, round: int, at: float, nodes: list[str]) -> None:
        def found(silent: list[str]) -> None:
            log.warning("members of the round stopped renewing their leases: dead", node=self.me.node, round=round,
                        silent=silent)  # fmt: skip
            if self.member.peer_failure_round == round:
                self._member_changed(dataclasses.replace(self.member, silent_peers=silent))

        try:
            await find_silent(self.client, self._settings.job, nodes, at, found)
        except etcd.TRANSIENT_ERRORS as exc:
            log.warning("could not read the round's leases; their TTL will tell", node=self.me.node, error=str(exc))

    def note_worker_exit_soon(self, round: int, note: str) -> None:
        """Record in the member key why a worker exited during the in-place re-form of
        ``round``'s world (``note``, one line): the controller tells it in the re-form's Event."""
        self._member_changed(dataclasses.replace(self.member, worker_exit=note, worker_exit_round=round))

    async def start_over(self) -> None:
        """Become a new agent of the same node (a new registration time, so a new agent id):
        the old one is the agent a round left out, and a round never admits that one again.
        The member key (same lease) says so at once, with its probation and warm-up; the next
        join record asks as the new one."""
        self.member = dataclasses.replace(
            self.member, round=0, joined_at=time.time(), not_before=self.not_before, warming_since=self.warming_since
        )
        self.me = dataclasses.replace(self.me, agent=agent_id(self.member))
        self._leased[self._member_key] = self.member.to_json()
        if self._keeper is not None:
            await self._put_leased(self._member_key, self._leased[self._member_key])

    def _member_changed(self, member: MemberRecord) -> None:
        self.member = member
        self._leased[self._member_key] = member.to_json()
        if self._member_update is None or self._member_update.done():
            self._member_update = asyncio.create_task(self._write_member(), name=f"rdzv-member-{self.me.node}")

    async def _write_member(self) -> None:
        # Writes the latest record; a round formed while writing is picked up by the loop.
        written = b""
        while self._keeper is not None and written != self._leased[self._member_key]:
            written = self._leased[self._member_key]
            try:
                await self.client.put(self._member_key, written, lease=self._keeper.lease)
            except etcd.TRANSIENT_ERRORS as exc:
                log.warning("member record update failed; retrying", node=self.me.node, error=str(exc))
                written = b""
                await asyncio.sleep(0.5)

    async def put_join(self, round: int) -> int:
        return await self._put_leased(self._join_key, self._join_record(round))

    def _join_record(self, round: int) -> bytes:
        me = self.me
        return JoinRecord(
            node=me.node, agent=me.agent, round=round, host=me.host, joined_at=time.time(), not_before=self.not_before
        ).to_json()

    async def close_round(self, step: CloseRound) -> tuple[bool, int]:
        """Compare-and-set the round state, dropping the stores of earlier rounds; returns (won, revision)."""
        tx = self.client.transactions
        ok, _ = await self.client.transaction(
            compare=[tx.mod(self._state_key) == step.expected_revision],
            success=[
                tx.put(self._state_key, step.state.to_json()),
                tx.delete(self._rounds_key, range_end=round_prefix(self._settings.job.rdzv, step.state.round).encode()),
            ],
            failure=[],
        )
        return ok, await self._revision()

    async def mark_closed(self, state: RoundState | None, revision: int) -> int:
        """Compare-and-set ``rdzv/state`` to closed (a run with no round yet gets a closed
        state of round 0); returns the revision, 0 if the state moved meanwhile."""
        tx = self.client.transactions
        base = state or RoundState(min_nodes=self._settings.min_nodes, max_nodes=self._settings.max_nodes)
        closed = dataclasses.replace(base, closed=True, reason="closed by set_closed()")
        ok, _ = await self.client.transaction(
            compare=[tx.mod(self._state_key) == revision],
            success=[tx.put(self._state_key, closed.to_json())],
            failure=[],
        )
        return await self._revision() if ok else 0

    async def claim_node(self, watch: JobWatch) -> None:
        """Refuse to start under a node name a live agent of another pod holds.

        A member key of the same pod is this pod's previous agent (pod names are unique
        while they live), whatever its lease says. Another pod's agent may be gone without
        its lease having run out yet: it is live only if its lease is renewed while we
        watch (a live agent renews every TTL/3); a dead one's key vanishes within the TTL.
        """
        loop = asyncio.get_running_loop()
        node, me = self.me.node, self.member
        while True:
            holder = watch.view.members.get(node)
            if holder is None or holder.pod == me.pod or agent_id(holder) == self.me.agent:
                return
            got = await self.client.get(self._member_key)
            if got is None:
                await watch.changed(1.0)
                continue
            lease = await self.client.get_lease_info(got.lease)
            if lease.TTL <= 0:
                await watch.changed(1.0)
                continue
            started = loop.time()
            horizon = min(float(lease.TTL), lease.grantedTTL / 2.0 + 1.0)
            while node in watch.view.members and loop.time() - started < horizon:
                await watch.changed(horizon - (loop.time() - started))
            if node not in watch.view.members:
                return
            again = await self.client.get_lease_info(got.lease)
            if again.TTL > lease.TTL - (loop.time() - started) + 1.0:
                raise DuplicateNode(
                    f"node name {node!r} is held by the live agent of pod {holder.pod} (host {holder.host or '?'}); "
                    "give each agent its own NODE_NAME, or --rdzv-conf node_name={hostname}-{pid} for several "
                    "agents on one host"
                )

    async def leave(self) -> bool:
        """Delete this agent's keys (revoking the lease removes them all at once); False when
        etcd could not be told (they then vanish with the lease's TTL)."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        for task in (self._renewal, self._member_update, self._probe):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._renewal = self._member_update = self._probe = None
        left = True
        if self._keeper is not None:
            keeper, self._keeper = self._keeper, None
            left = await keeper.stop(revoke=True)
        self._leased.clear()
        return left

    # -- internals ---------------------------------------------------------------------

    async def _put_leased(self, key: bytes, value: bytes) -> int:
        if self._keeper is None:
            raise RuntimeError("agent not registered")
        self._leased[key] = value
        response = await self.client.put(key, value, lease=self._keeper.lease)
        return int(response.header.revision)

    async def _revision(self) -> int:
        response = await self.client.get(self._state_key)
        return int(response.header.revision) if response is not None else 0

    def _new_keeper(self) -> etcd.LeaseKeeper:
        return etcd.LeaseKeeper(self.client, self._settings.lease_ttl, on_lost=self._lease_lost)

    def _on_view(self, view: JobView) -> None:
        """A member of this agent's round reported a failed collective: renew this agent's
        lease at once and often while the survivors probe the round's leases
        (``regroup.rendezvous.silent``), so that it does not read as dead."""
        round = self.member.round
        if round <= 0 or self._keeper is None:
            return
        newest = max((m.peer_failure_at for m in view.members.values() if m.peer_failure_round == round), default=0.0)
        if newest > self._hurried_for:
            self._hurried_for = newest
            self._keeper.hurry(HURRY_EVERY, HURRY_FOR)

    def _lease_lost(self) -> None:
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.create_task(self._renew(), name=f"rdzv-lease-renew-{self.me.node}")

    async def _renew(self) -> None:
        """Grant a new lease and write this agent's keys again, retrying until etcd answers."""
        backoff = 0.1
        while True:
            try:
                keeper = self._new_keeper()
                await keeper.start()
                old, self._keeper = self._keeper, keeper
                if old is not None:
                    await old.stop(revoke=False)
                for key, value in list(self._leased.items()):
                    await self.client.put(key, value, lease=keeper.lease)
                log.warning("lease re-granted after loss", node=self.me.node, lease=keeper.id)
                return
            except etcd.TRANSIENT_ERRORS as exc:
                log.warning("lease re-grant failed; retrying", node=self.me.node, error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
