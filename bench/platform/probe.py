"""The probe job: the same job, re-formed again and again, its latency timed each time.

One cycle takes one of its nodes away, a reclaim notice and an abrupt loss in turn, and
brings a fresh one back:

- ``reclaim`` / ``loss``: from the taint being written (the agent's death) until every
  agent of the job's next world, one node smaller, returned from ``next_rendezvous``;
- ``grow``: from the fresh node's pod being created and its agent started until every
  agent of the world at full size returned (a grow that fills the job to its maximum does
  not wait out the join window).

Each change waits for the job to train in its new world (rank 0 published its first step
there): the controller plans a shrink only for a trainer that answers, and the probe
measures the same path every time.

A loss waits out the dead agent's lease TTL (nothing tells the job sooner), so its
latency is that TTL plus the re-form; a reclaim is planned by the controller (checkpoint
request, ack at the trainer's next step boundary, expected membership, re-form request),
so its latency is the platform's, plus up to one step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from bench._stats import percentile
from bench.platform.jobs import Job, Jobs, News

KINDS = ("reclaim", "loss", "grow")
CYCLE_KINDS = ("reclaim", "loss")
"""What takes the node away, in turn."""


@dataclass
class ProbeResult:
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        return {
            kind: {
                "n": len(values),
                "failed": self.failed[kind],
                "p50_s": percentile(values, 0.50),
                "p99_s": percentile(values, 0.99),
                "max_s": max(values, default=None),
            }
            for kind, values in self.samples.items()
        }


async def _next_world(news: News, job: str, after: int, size: int, timeout: float) -> float | None:
    """When a world of ``size`` newer than round ``after`` formed, or None."""

    def found() -> float | None:
        for world in news.worlds.get(job, []):
            if world.round > after and world.world_size == size:
                return world.at
        return None

    return await news.until(found, timeout)


async def _trained(news: News, job: str, timeout: float) -> bool:
    """Until the trainer stepped in the job's newest world."""
    world = news.world(job)
    return bool(world) and bool(await news.until(lambda: news.resumed.get(job, 0) >= world.round, timeout))


async def run_probe(jobs: Jobs, news: News, job: Job, cycles: int, seed: int, timeout: float) -> ProbeResult:
    """``cycles`` cycles of each kind in ``CYCLE_KINDS``, one after the other."""
    rng = random.Random(seed)
    result = ProbeResult()
    full = job.max_nodes
    for index in range(cycles * len(CYCLE_KINDS)):
        kind = CYCLE_KINDS[index % len(CYCLE_KINDS)]
        if not await _trained(news, job.name, timeout):
            result.failed[kind] += 1
            return result  # the probe job does not train: later cycles would not measure the same thing
        before = news.world(job.name)
        assert before is not None
        node = rng.choice(job.live)
        started = time.time()
        (jobs.kill if kind == "loss" else jobs.reclaim)(job, node)
        formed = await _next_world(news, job.name, before.round, full - 1, timeout)
        if formed is None:
            result.failed[kind] += 1
        else:
            result.samples[kind].append(formed - started)
            await _trained(news, job.name, timeout)
        shrunk = news.world(job.name)
        started = time.time()
        jobs.replace(job)
        formed = await _next_world(news, job.name, shrunk.round if shrunk else 0, full, timeout)
        if formed is None:
            result.failed["grow"] += 1
            return result  # the probe job is not whole again: later cycles would not measure the same thing
        result.samples["grow"].append(formed - started)
    return result
