"""Workers tell their agent whether they failed of their own or because a peer went away."""

from __future__ import annotations

from pathlib import Path

from regroup.failures import (
    FAILURE_DIR_ENV,
    OWN,
    PEER,
    charged,
    failed_peer,
    failure_kind,
    record_failure,
    take_failures,
)

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1685: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


class DistBackendError(RuntimeError):
    """Stands in for torch.distributed.DistBackendError (matched by name: no torch here)."""


def test_collective_errors_are_peer_failures_and_the_rest_are_own() -> None:
    assert failure_kind(RuntimeError(GLOO_PEER_GONE)) == PEER
    assert failure_kind(DistBackendError("NCCL communicator was aborted")) == PEER
    assert failure_kind(RuntimeError("CUDA out of memory")) == OWN
    assert failure_kind(ValueError("loss is NaN")) == OWN


def test_a_peer_failure_names_the_host_gloo_gives() -> None:
    assert failed_peer(RuntimeError(GLOO_PEER_GONE)) == "127.0.0.1"
    closed = "[../gloo/transport/tcp/pair.cc:538] Connection closed by peer [10.4.2.17]:47120"
    assert failed_peer(RuntimeError(closed)) == "10.4.2.17"
    assert failed_peer(RuntimeError("Connection closed by peer [fd00::3a]:4012")) == "fd00::3a"
    assert failed_peer(DistBackendError("NCCL communicator was aborted")) == "", "NCCL names no peer"
    assert failed_peer(RuntimeError("bad index [10.0.0.1]:3 in my own code")) == "", "not a peer failure"


def test_a_node_is_charged_unless_its_ranks_only_saw_peers_fail(tmp_path: Path) -> None:
    env = {FAILURE_DIR_ENV: str(tmp_path), "LOCAL_RANK": "1"}
    record_failure(RuntimeError(GLOO_PEER_GONE), env)
    kinds = take_failures(tmp_path)
    assert kinds == [PEER] and not charged(kinds)
    assert take_failures(tmp_path) == [], "reports are consumed once"
    assert charged([]), "a rank killed outright reports nothing: its own fault"
    assert charged([PEER, OWN])


def test_record_failure_without_an_agent_folder_does_nothing(tmp_path: Path) -> None:
    record_failure(RuntimeError("x"), {"LOCAL_RANK": "0"})
    assert list(tmp_path.iterdir()) == []
