"""A standalone c10d ``TCPStore`` for the plain-torchrun baseline of ``regroup demo``.

``python -m regroup.demo.c10d_store PORT`` serves until SIGTERM; it prints ``ready PORT``
once it listens (PORT 0: a port the kernel picks, so no number is chosen before the bind).
Running the store on its own (as a platform would run a rendezvous service) keeps the
baseline from dying just because the node that happened to host the store was the one lost.
"""

from __future__ import annotations

import signal
import sys
import threading
from datetime import timedelta


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m regroup.demo.c10d_store PORT", file=sys.stderr)
        return 2
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", int(argv[0]), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"ready {store.port}", flush=True)
    stop.wait()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
