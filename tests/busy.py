"""Run a command while every core is kept busy: ``python tests/busy.py CMD...``.

The suite must pass on a loaded machine, not only on a quiet one (a test that needs a
quiet machine depends on timing). ``make test-busy`` runs ``make test``'s pytest under
this: one spinning process per core (``os.cpu_count()``, or ``--spinners N``) at normal
priority, started before the command and ended after it, whatever its outcome. Only the
spinners this script started are ever signalled. The exit code is the command's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time


def spin() -> None:
    """Burn one core until terminated."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tests/busy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run under load")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given")
    spinners = [multiprocessing.Process(target=spin, daemon=True, name=f"busy-{i}") for i in range(args.spinners)]
    for process in spinners:
        process.start()
    started = time.monotonic()
    print(f"busy.py: {len(spinners)} spinning processes; running {' '.join(args.command)}", flush=True)
    try:
        return subprocess.call(args.command)
    finally:
        for process in spinners:
            process.terminate()
        for process in spinners:
            process.join(timeout=5)
        print(f"busy.py: command ran {time.monotonic() - started:.0f}s with {len(spinners)} cores kept busy", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
