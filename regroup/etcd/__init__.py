"""The one layer of regroup that imports aetcd; everything else talks to etcd through it.

- ``settings``: ``EtcdSettings`` (endpoints, TLS and auth), parsed once at the edge.
- ``client``: ``connect()``, an ``aetcd.Client`` on the first endpoint that answers (TLS
  added here because aetcd itself only opens insecure channels); the errors callers see,
  ``TRANSIENT_ERRORS`` (the ones worth trying again) among them, and ``PermissionDenied``,
  which names the operation, the key and the identity etcd refused; ``enable_auth``.
- ``auth``: etcd identities and roles: each job's own user and role, the controller's
  ``bootstrap`` of etcd auth (imported as ``regroup.etcd.auth``, by the controller only).
- ``lease``: ``LeaseKeeper``, the owned task that refreshes a lease until cancelled;
  ``renewed_within``, whether another holder's lease was renewed in the last second
  (aetcd has no background keep-alive).
- ``watch``: ``open_watch`` and ``close_watch``, so a cancellation that lands while
  aetcd creates a watch is never lost.
- ``reflector``: ``Reflector``, the one list-and-watch loop: every watch of the project is
  one of its watches.
- ``loop_thread``: ``LoopThread``, an asyncio loop in a daemon thread for synchronous
  callers (the torchrun rendezvous handler, the training loop); ``loop_threads`` lists the
  open ones and what went wrong on them (the test suite fails a test that leaks either).
"""

import os

# gRPC's fork support, on by default, runs its fork handlers only when no other thread is
# inside gRPC; otherwise it skips them and leaves the child's copy of gRPC half-stopped, and
# a DataLoader worker forked while the trainer's etcd channel has a call in flight dies of
# SIGSEGV (grpc/grpc#32992; 44 loaders of 150 at one put a step, none of 300 without it).
# No process of regroup's uses gRPC in a forked child (workers are started with exec), so it
# is off before aetcd loads gRPC, unless whoever runs the process said otherwise.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from regroup.etcd.client import (  # noqa: E402 (after the setting above)
    TRANSIENT_ERRORS,
    Client,
    ClientError,
    ConnectionFailedError,
    ConnectionTimeoutError,
    EtcdUnavailable,
    PermissionDenied,
    RevisionCompactedError,
    UnauthenticatedError,
    connect,
    enable_auth,
    is_permission_denied,
    make_client,
)
from regroup.etcd.lease import LeaseKeeper, renewed_within
from regroup.etcd.loop_thread import LoopMark, LoopProblem, LoopThread, LoopThreads, loop_threads
from regroup.etcd.reflector import Backoff, Deleted, Listed, Put, Reflector, ReflectorEvent, ReflectorState
from regroup.etcd.settings import Endpoint, EtcdSettings, parse_endpoints
from regroup.etcd.watch import EventKind, Watch, close_watch, open_watch

__all__ = [
    "TRANSIENT_ERRORS",
    "Backoff",
    "Client",
    "ClientError",
    "ConnectionFailedError",
    "ConnectionTimeoutError",
    "Deleted",
    "Endpoint",
    "EtcdSettings",
    "EtcdUnavailable",
    "EventKind",
    "LeaseKeeper",
    "renewed_within",
    "Listed",
    "LoopMark",
    "LoopProblem",
    "LoopThread",
    "LoopThreads",
    "PermissionDenied",
    "Put",
    "Reflector",
    "ReflectorEvent",
    "ReflectorState",
    "RevisionCompactedError",
    "UnauthenticatedError",
    "Watch",
    "close_watch",
    "connect",
    "enable_auth",
    "is_permission_denied",
    "loop_threads",
    "make_client",
    "parse_endpoints",
    "open_watch",
]
