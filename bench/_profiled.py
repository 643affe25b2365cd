"""Run a training script under cProfile (``python -m bench script --profile DIR``).

``python bench/_profiled.py OUTDIR SCRIPT [ARGS...]`` runs SCRIPT as ``python SCRIPT ARGS``
would (its folder first on ``sys.path``) and, when it ends however it ends, writes to
``OUTDIR/<NODE_NAME or rank RANK>-<pid>``:

- ``.prof``: the main thread's profile; the clock is its CPU time (``time.thread_time``),
  or wall time with ``REGROUP_BENCH_PROFILE_CLOCK=wall``;
- ``.threads.json``: every thread's CPU seconds (``/proc/self/task``) every half second,
  ``[{"t": epoch, "threads": {tid: [python name or "native", cpu_s]}}]``: what the threads
  the profile does not see (snapshot copies, etcd clients, gloo's own) cost.
"""

import cProfile
import json
import os
import runpy
import sys
import threading
import time

out, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
label = os.environ.get("NODE_NAME") or f"rank{os.environ.get('RANK', 'x')}"
base = os.path.join(out, f"{label}-{os.getpid()}")
ticks = os.sysconf("SC_CLK_TCK")
samples = []
done = threading.Event()


def threads_now():
    names = {t.native_id: t.name for t in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[tid] = [names.get(int(tid), "native"), (int(fields[11]) + int(fields[12])) / ticks]
    return {"t": time.time(), "threads": found}


def sample_threads():
    while not done.wait(0.5):
        samples.append(threads_now())


threading.Thread(target=sample_threads, name="bench-thread-sampler", daemon=True).start()
clock = time.perf_counter if os.environ.get("REGROUP_BENCH_PROFILE_CLOCK") == "wall" else time.thread_time
profile = cProfile.Profile(clock)
try:
    profile.runcall(runpy.run_path, script, run_name="__main__")
finally:
    done.set()
    samples.append(threads_now())
    profile.dump_stats(base + ".prof")
    with open(base + ".threads.json", "w") as f:
        json.dump(samples, f)
