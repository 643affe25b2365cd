"""``python -m bench platform [--quick] [--jobs 10,50,200] [--agents 16] [--auth off|on|both]``: how many jobs one etcd member serves.

Every job's membership, rounds, plans, acks and progress live in one etcd. For each size,
on a fresh platform: one etcd (``--enable-pprof``), the controller in a process of its own
running what ``regroup controller`` runs against the Kubernetes API stand-in (the real
list+watch client over HTTP), and J background jobs plus one probe job, N agents each, of
the real ``etcd-v3`` rendezvous. The agents are threads of a few agent host processes
(``agent_host``), each running torchrun's agent loop (``job_agents``); each job's trainer
rank 0 is the trainer's own etcd channel, writing progress at the trainer's interval and
acking checkpoint requests at a step boundary (``rank_zero``). Churn runs across the
background jobs at a stated rate per job (``churn``) while the probe job is re-formed again
and again and timed (``probe``); the probe alone, on its own platform, runs first and
anchors the ratios. At the end every job ends and the benchmark checks that the ended jobs'
prefixes are empty and the lease count is back to its start (``size_run``).

Each size runs with etcd authentication off, then on (``--auth both``, the default), each
on a fresh platform, so both see the machine as it is then. On is production's setting of
one identity per job (``etcd_auth``): etcd serves TLS with ``--client-cert-auth``, auth is
bootstrapped by ``regroup etcd-auth bootstrap``, the controller presents its certificate
and runs with ``--etcd-job-identities`` (making each job's user and role, and removing them
at its clean-up), and each job's agents and rank 0 present the job's own certificate. The
end check then also asks that no ended job's user or role is left.

What the harness hides, and which way it leans:

- no trainers: no GPUs, no collectives, no checkpoints written; the trainer's etcd
  traffic is there (``rank_zero``), its compute is not;
- a job's agents share one etcd connection and one watch of the job's prefix per host
  process, where torchrun's agents open one each: etcd serves 1/N of production's watchers
  and sends 1/N of its watch events (optimistic for etcd's fan-out). Every agent still has
  its own lease, keep-alives, member key, join records and round writes, so the writes and
  the lease load are production's;
- the agents' Python runs under a few GILs on the same two cores as etcd and the
  controller, where production gives each agent a node: the agent hosts' CPU is reported,
  and what it takes from etcd and the controller leans pessimistic;
- a node that dies stays in the cluster until it is replaced (as a kubelet that stopped
  reporting, before the node lifecycle controller acts), so a loss is seen through the
  lease TTL, as the agents see it.
"""


def main(argv: list[str]) -> int:
    """The command (imported on use: the controller's process imports this package too,
    and must not pay for the benchmark's imports)."""
    from bench.platform.cli import main as run

    return run(argv)
