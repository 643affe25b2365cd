"""The background jobs' churn: a seeded Poisson stream of losses, reclaims and finished jobs.

Events arrive at ``rate_per_job_min`` per job per minute in all, so the load per job is
the same at every size. Each picks a job that has nothing in flight:

- ``loss``: an agent dies without a word (``Jobs.kill``); ``replace_after`` later its node
  and pod leave the cluster and a fresh node joins (a grow);
- ``reclaim``: a reclaim taint on a node (the controller plans a shrink with a checkpoint);
  ``replace_after`` later the node is gone and a fresh node joins;
- ``finish``: the job's run ends (rendezvous closed, agents gone, pods deleted) and a new
  job of the same size starts in its place.

A loss or a reclaim never takes a job below its minimum.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from bench.platform.jobs import Job, Jobs, News

KINDS = {"loss": 0.4, "reclaim": 0.4, "finish": 0.2}
"""Each event's kind, drawn with these weights."""


@dataclass
class Churn:
    jobs: Jobs
    news: News
    background: Callable[[], list[Job]]
    """The background jobs now (the probe is never churned)."""
    start_job: Callable[[], object]
    """Starts a new job in place of a finished one."""
    rate_per_job_min: float
    replace_after: timedelta
    seed: int
    counts: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    """Events that found no job free to take them."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self) -> None:
        """Until cancelled; in-flight replacements are left to ``settle``."""
        rng = random.Random(self.seed)
        kinds, weights = list(KINDS), list(KINDS.values())
        while True:
            jobs = self.background()
            rate = self.rate_per_job_min * len(jobs) / 60.0
            if rate <= 0:
                return
            await asyncio.sleep(rng.expovariate(rate))
            kind = rng.choices(kinds, weights)[0]
            free = [j for j in self.background() if not j.busy and not j.ended]
            if kind != "finish":
                free = [j for j in free if len(j.live) > j.min_nodes]
            if not free:
                self.skipped += 1
                continue
            job = rng.choice(free)
            job.busy = True
            self.counts[kind] += 1
            if kind == "finish":
                self._own(self._finish(job))
                continue
            node = rng.choice(job.live)
            (self.jobs.kill if kind == "loss" else self.jobs.reclaim)(job, node)
            self._own(self._replace(job))

    def _own(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)

    async def _replace(self, job: Job) -> None:
        await asyncio.sleep(self.replace_after.total_seconds())
        if not job.ended:
            self.jobs.replace(job)
            self.counts["join"] += 1
        job.busy = False

    async def _finish(self, job: Job) -> None:
        await self.jobs.finish(job, self.news, timedelta(seconds=60))
        self.start_job()

    async def settle(self) -> None:
        """Wait for the changes in flight; a change that failed goes into the run's errors."""
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        self.news.errors += [f"churn: {type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
