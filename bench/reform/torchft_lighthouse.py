"""The torchft lighthouse of ``bench reform``'s torchft mode, in a process of its own so
that its log (every quorum it issues, and why) goes to the run's log folder, not the
bench's terminal.

``python -m bench.reform.torchft_lighthouse --min-replicas 2 --heartbeat-timeout-ms 5000 ...``

It binds a free port on 127.0.0.1, says ``ready PORT`` on stdout, and serves until SIGTERM
or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reform.torchft_lighthouse", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--join-timeout-ms", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-ms", type=int, required=True)
    parser.add_argument("--quorum-tick-ms", type=int, required=True)
    args = parser.parse_args(argv)
    # Blocked before the server's threads start, so they inherit the mask and sigwait gets the signal.
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    # address() names the host; the port is all that is needed, the replicas dial 127.0.0.1.
    print(f"ready {int(server.address().rsplit(':', 1)[1])}", flush=True)
    signal.sigwait(stops)
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
