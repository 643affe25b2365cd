"""Creating one world's default process group: reach its store, then connect the ranks.

Both steps are bounded so that ``ElasticWorld`` can notice a newer world (or a stop)
while one forms, instead of waiting out the collective timeout.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import structlog
import torch.distributed as dist

from regroup.rendezvous.inplace.channel import WAIT_EXPIRED
from regroup.rendezvous.inplace.membership import Membership, ReformFailed, Superseded

log = structlog.get_logger("regroup.inplace.world")

_CONNECT_TRY = timedelta(seconds=2)
"""One try at reaching a world's store; between tries, a newer world is looked for."""
_PROBE_EVERY_S = 0.01
"""How often a rank looks whether rank 0's store listens yet. torch's store client retries
a refused connection with an exponential back-off: a rank that asked 0.3 s before rank 0
listened connected only 0.45-1.2 s after it did, on every re-form where rank 0 came last."""
_MESH_TIMEOUT = timedelta(seconds=30)
"""How long a world's process group may take to connect its ranks. gloo keeps retrying a
failed formation's connections in the background for the group's timeout; with the
collective timeout (10 min) there, one failed formation could hold up the next ones. The
group gets the collective timeout once it has formed."""


def init_default_group(backend: str, membership: Membership, store: dist.Store | None, timeout: timedelta) -> None:
    """Create the default process group of ``membership`` on ``store`` (a world of one
    without an address: no store). Its collectives get ``timeout`` once it has formed."""
    if store is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),  # as env:// would
        rank=membership.rank,
        world_size=membership.world_size,
        timeout=min(timeout, _MESH_TIMEOUT),
    )
    dist.distributed_c10d._set_pg_timeout(timeout)


def side_group(timeout: timedelta, connect: timedelta = _MESH_TIMEOUT) -> dist.ProcessGroup:
    """A gloo group of every rank of the current world, beside its default group (a
    collective: every rank creates its side groups in the same order). Connecting it is
    bounded by ``connect`` (``_MESH_TIMEOUT``, as the default group's is); its collectives
    get ``timeout`` once it has formed. With ``timeout`` there, a peer that died after it published its
    address held every other rank in gloo's constructor, retrying that connection, for the
    collective timeout (10 min): severing cannot end a connect that is retried, and the
    re-form that drops the dead peer waited on them."""
    group = dist.new_group(backend="gloo", timeout=min(timeout, connect))
    dist.distributed_c10d._set_pg_timeout(timeout, group)
    return group


def connect_store(
    membership: Membership, timeout: timedelta, form_timeout: timedelta, give_up: Callable[[], bool]
) -> dist.Store:
    """The world's TCPStore (hosted by its rank 0), with ``timeout`` for its reads.
    Connecting is retried in short tries, so that ``give_up()`` (a newer world, a stop) is
    noticed while rank 0 is not (or no longer) there: then ``Superseded``; after
    ``form_timeout``, ``ReformFailed``."""
    deadline = time.monotonic() + form_timeout.total_seconds()
    tries = 0
    while True:
        tries += 1
        try:
            if membership.rank != 0:
                _await_listening(membership.master_addr, membership.master_port, _CONNECT_TRY, give_up)
            store = dist.TCPStore(
                membership.master_addr,
                membership.master_port,
                membership.world_size,
                membership.rank == 0,
                timeout=_CONNECT_TRY,
                wait_for_workers=False,
            )
        except (RuntimeError, dist.DistError, OSError) as exc:
            if give_up():
                raise Superseded(f"could not reach the store of round {membership.round}: {exc}") from exc
            if time.monotonic() >= deadline:
                log.warning(
                    WAIT_EXPIRED,
                    waited_for=f"the store of round {membership.round}, hosted by its rank 0",
                    timeout_s=form_timeout.total_seconds(),
                    rank=membership.rank,
                    round=membership.round,
                    tries=tries,
                    not_answered=[{"who": "rank 0", "store": f"{membership.master_addr}:{membership.master_port}",
                                   "last_error": str(exc)[:300]}],
                )
                raise ReformFailed(
                    f"could not reach the store of round {membership.round} within {form_timeout}: {exc}"
                ) from exc
            if tries in (1, 5) or tries % 30 == 0:
                log.warning("the world's store is not reachable yet; retrying", round=membership.round,
                            rank=membership.rank, host_it=membership.rank == 0, tries=tries, error=str(exc)[:300])
            continue
        store.set_timeout(timeout)
        return store


def _await_listening(host: str, port: int, within: timedelta, give_up: Callable[[], bool]) -> None:
    """Return once ``host:port`` accepts a TCP connection (closed at once: torch's store
    server drops a client that never speaks), looking every 10 ms for up to ``within``;
    ``OSError`` when it does not, or as soon as ``give_up()`` turns true."""
    deadline = time.monotonic() + within.total_seconds()
    while True:
        try:
            with socket.create_connection((host, port), timeout=_PROBE_EVERY_S * 10):
                return
        except OSError:
            if give_up() or time.monotonic() >= deadline:
                raise
        time.sleep(_PROBE_EVERY_S)
