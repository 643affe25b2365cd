"""How a worker tells its torchrun agent why it failed: its own fault, or a peer's.

When one rank crashes, its peers' ranks fail too, inside the collective they were
waiting in. Counting every node's failure would charge bystanders for the crash (and
cordon the wrong node in a restart storm). The rendezvous handler gives its workers a
folder through ``FAILURE_DIR_ENV`` (torchrun passes the agent's environment on); a
failing rank writes ``peer`` or ``own`` there under its local rank. The handler charges
a failed round to its node unless its ranks only reported peer failures. A rank killed
outright writes nothing, which counts as its own fault.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FAILURE_DIR_ENV = "REGROUP_FAILURE_DIR"
PEER = "peer"
OWN = "own"

# gloo reports a vanished peer as a plain RuntimeError from its TCP transport.
_PEER_MESSAGES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def failure_kind(exc: BaseException) -> str:
    """``peer`` if ``exc`` says a peer rank went away during a collective, else ``own``."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"DistBackendError", "DistNetworkError"}:
        return PEER
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_MESSAGES):
        return PEER
    return OWN


# gloo names the other end of the broken pair: "Connection closed by peer [10.0.3.7]:47120".
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")


def failed_peer(exc: BaseException) -> str:
    """The host of the peer a failed collective names (gloo: ``[host]:port``), "" if none."""
    match = _PEER_ADDRESS.search(str(exc))
    return match.group(1) if match and failure_kind(exc) == PEER else ""


def record_failure(exc: BaseException, env: dict[str, str] | None = None) -> None:
    """Tell the agent (if it asked) why this rank failed. Never raises."""
    env = dict(os.environ) if env is None else env
    folder = env.get(FAILURE_DIR_ENV)
    if not folder:
        return
    try:
        Path(folder, env.get("LOCAL_RANK", "0")).write_text(failure_kind(exc))
    except OSError:
        pass


def recorded(folder: str | os.PathLike[str], local_rank: int) -> bool:
    """Whether worker ``local_rank`` told why it failed (not yet taken by ``take_failures``)."""
    return Path(folder, str(local_rank)).exists()


def take_failures(folder: str | os.PathLike[str]) -> list[str]:
    """The kinds the workers reported since the last call, clearing them."""
    kinds = []
    for path in Path(folder).iterdir():
        try:
            kinds.append(path.read_text().strip())
            path.unlink()
        except OSError:
            continue
    return kinds


def charged(kinds: list[str]) -> bool:
    """Whether a failed round counts against this node: not when its ranks only saw peers fail."""
    return not kinds or any(kind != PEER for kind in kinds)
