"""Making a collective that waits on a dead or hung peer fail, without killing the process.

NCCL communicators are aborted through torch (``ncclCommAbort``). gloo in torch 2.13 has no
abort that wakes a blocked call, so the process shuts down the TCP connections its process
groups opened: gloo's pending read then fails with "Connection closed by peer", exactly as
if the peer had died, and the call raises. Listening sockets are left alone (gloo treats a
failed ``accept`` as fatal), and so are connections the caller wants kept (its etcd client).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

import structlog
import torch.distributed as dist

log = structlog.get_logger("regroup.inplace.abort")


def socket_inodes() -> set[str]:
    """Inodes of every socket this process has open (``socket:[N]``)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target)
    return found


def sever_connections(baseline: set[str], keep_ports: Iterable[int] = ()) -> int:
    """Shut down every connected TCP socket opened since ``baseline`` (a ``socket_inodes()``
    snapshot), except those whose remote port is in ``keep_ports``. Returns how many."""
    keep = set(keep_ports)
    severed = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:[") or target in baseline:
            continue
        try:
            # A duplicate: shutdown() acts on the socket itself, close() only on the copy.
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            if sock.getpeername()[1] in keep:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:
            continue  # not connected, or already gone
        finally:
            sock.close()
    return severed


def abort_groups() -> None:
    """Abort every process group of this process (NCCL: ``ncclCommAbort``), then forget them."""
    if not dist.is_initialized():
        forget_failed_formation()
        return
    try:
        dist.distributed_c10d._abort_process_group(dist.group.WORLD)
    except (RuntimeError, ValueError, AttributeError) as exc:
        log.warning("process group abort failed; destroying it", error=str(exc))
        with contextlib.suppress(RuntimeError, ValueError, AssertionError):
            dist.destroy_process_group()


def forget_failed_formation() -> None:
    """Undo what a failed ``init_process_group`` left behind, so the process can form a world
    again. torch 2.13 names the default group after a counter it bumps before connecting and
    resets only in ``destroy_process_group``, which a group that never formed cannot reach:
    the next group would be named "1" while the peers name theirs "0", and their stores'
    prefixes would never meet."""
    if dist.is_initialized():
        return
    dist.distributed_c10d._world.group_count = 0
