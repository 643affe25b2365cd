"""A container for the kubelet tests, which reports to the test what happens to it.

    python reporting_container.py PORT MODE [ARGS...]

The process connects to 127.0.0.1:PORT and writes lines ``<word> <pid>``: ``started`` at
once, ``ready`` once it runs on in MODE (its SIGTERM handling in place), ``term`` when it
gets SIGTERM. Its connection ends when it dies, which the test sees without polling. MODE:

- ``sleep``: run until killed (SIGTERM's default action ends it);
- ``exit CODE``: exit with CODE;
- ``codes COUNTER CODES``: exit with the next of the comma-separated CODES (the file COUNTER
  counts the starts), then, once they are used up, run until killed;
- ``ignore``: report SIGTERM and run on;
- ``trap``: report SIGTERM and exit 0;
- ``parent same|new MODE ...``: first start a child (``sleep``) in this session or a new one,
  wait until it has reported, then behave as MODE ...
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    port, mode, args = int(argv[0]), argv[1], argv[2:]
    beacon = socket.create_connection(("127.0.0.1", port))

    def say(word: str) -> None:
        beacon.sendall(f"{word} {os.getpid()}\n".encode())

    say("started")
    print("ready", flush=True)  # a parent waits for this line before going on
    if mode == "parent":
        child = subprocess.Popen(
            [sys.executable, __file__, str(port), "sleep"],
            stdout=subprocess.PIPE,
            start_new_session=args[0] == "new",
        )
        assert child.stdout is not None
        child.stdout.readline()
        mode, args = args[1], args[2:]
    if mode == "exit":
        return int(args[0])
    if mode == "codes":
        counter = Path(args[0])
        started = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(started + 1))
        codes = [int(c) for c in args[1].split(",")]
        if started < len(codes):
            return codes[started]
    elif mode == "ignore":
        signal.signal(signal.SIGTERM, lambda *_: say("term"))
    elif mode == "trap":

        def stop(*_: object) -> None:
            say("term")
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
    elif mode != "sleep":
        raise SystemExit(f"unknown mode {mode!r}")
    say("ready")  # its signal handling is in place
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
