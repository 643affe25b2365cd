"""torch's rendezvous scenarios, as behaviours any backend must show, in our own words.

Taken from three torch test files (``test/distributed/...``):

- ``dynamic_rendezvous_test.py`` (``IntegrationTest``, ``DynamicRendezvousHandlerTest``):
  the handler contract, driven here through handlers that torch's registry makes;
- ``run_test.py``: launches through torchrun's command line;
- ``local_elastic_agent_test.py``: agents with workers that succeed, fail, drift apart,
  and agents that are killed.

torch drives most of these with mocks (a fake state holder, a patched ``sync``); here each
runs against the real backend: a real etcd, a real TCPStore, real torchrun agents.
Workers are ``worker.py`` (no torch) unless a scenario needs a process group or torch's
error files (``torch_worker.py``).

This package holds the catalogue (``SCENARIOS``, with what etcd-v3 need not pass and what
c10d fails through known torch bugs); the scenarios live in its modules by theme:
``membership``, ``closing``, ``lost_backend``, ``configuration`` (handler level),
``launches``, ``agent_failures``, ``exit_barrier`` (torchrun agents).
"""

from __future__ import annotations

from tests.rendezvous.conformance.runner import Scenario
from tests.rendezvous.conformance.scenarios.agent_failures import (
    duplicate_node_name,
    elastic_scale_down,
    fault_tolerance,
    waiting_node_takes_over,
)
from tests.rendezvous.conformance.scenarios.closing import closed_raises, set_closed, shutdown_closes
from tests.rendezvous.conformance.scenarios.configuration import (
    agent_store_default,
    agent_store_disabled,
    identity,
    local_addr,
)
from tests.rendezvous.conformance.scenarios.exit_barrier import (
    barrier_failure,
    drift_fail,
    drift_success,
    no_barrier_on_failure,
)
from tests.rendezvous.conformance.scenarios.launches import (
    agent_raises,
    gloo_sum,
    launch_line_unchanged,
    ranks_of_two_agents,
    restart_recovers,
    restarts_exhausted,
    worker_raises,
)
from tests.rendezvous.conformance.scenarios.lost_backend import close_timeout, queries_raise, shutdown_false
from tests.rendezvous.conformance.scenarios.membership import (
    all_nodes_join,
    beyond_max_waits,
    join_timeout,
    next_round_each_call,
    num_nodes_waiting,
)

DYN = "dynamic_rendezvous_test.py"
RUN = "run_test.py"
LEA = "local_elastic_agent_test.py"


SCENARIOS = [
    # dynamic_rendezvous_test.py
    Scenario(
        "all-join", "all nodes join: distinct ranks, one world size, one store",
        f"{DYN}::test_all_nodes_join_rendezvous", all_nodes_join, in_process=True,
    ),
    Scenario(
        "beyond-max", "a node beyond max gets no place and makes no member restart; it ends when the run closes",
        f"{DYN}::test_redundancy_list", beyond_max_waits, cost=3, in_process=True,
    ),
    Scenario(
        "num-waiting", "num_nodes_waiting() counts a joiner; the next round takes it in",
        f"{DYN}::test_num_nodes_waiting_returns_expected_value", num_nodes_waiting, cost=2, in_process=True,
    ),
    Scenario(
        "set-closed", "set_closed() before any round, idempotent; is_closed() everywhere",
        f"{DYN}::test_set_closed_can_be_called_multiple_times", set_closed, in_process=True,
    ),
    Scenario(
        "closed-raises", "next_rendezvous() on a closed run raises RendezvousClosedError (member and newcomer)",
        f"{DYN}::test_set_closed_closes_rendezvous", closed_raises, in_process=True,
    ),
    Scenario(
        "shutdown", "shutdown() closes the run and returns True; idempotent",
        f"{DYN}::test_shutdown_closes_rendezvous_and_returns_true", shutdown_closes, in_process=True,
    ),
    Scenario(
        "shutdown-false", "shutdown() returns False when it cannot close (backend gone)",
        f"{DYN}::test_shutdown_returns_false_if_rendezvous_cannot_be_closed", shutdown_false, cost=4,
    ),
    Scenario(
        "close-timeout", "set_closed() on a stalled backend raises within its timeouts",
        f"{DYN}::test_set_closed_respects_the_requested_timeout", close_timeout, cost=4,
    ),
    Scenario(
        "lost-queries", "with the backend gone, is_closed() and num_nodes_waiting() raise a RendezvousError",
        f"{DYN}::test_num_nodes_waiting_records_and_raises_exceptions", queries_raise, cost=3,
    ),
    Scenario(
        "join-timeout", "next_rendezvous() raises RendezvousTimeoutError after join_timeout",
        f"{DYN}::test_next_rendezvous_respects_the_requested_timeout", join_timeout, cost=2, in_process=True,
    ),
    Scenario(
        "next-round", "next_rendezvous() called again moves to the next round (fresh store)",
        f"{DYN}::test_next_rendezvous_moves_to_next_round_if_called_repeatedly", next_round_each_call, in_process=True,
    ),
    Scenario(
        "identity", "get_run_id() and get_backend()",
        f"{DYN}::test_create_handler_returns_handler", identity, in_process=True,
    ),
    Scenario(
        "local-addr", "local_addr becomes master_addr",
        f"{DYN}::test_create_handler_rdzv_local_addr", local_addr, in_process=True,
    ),
    Scenario(
        "agent-store", "use_agent_store is True by default",
        f"{DYN}::test_use_agent_store_is_true_by_default", agent_store_default, in_process=True,
    ),
    Scenario(
        "agent-store-off", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: use_agent_store is False",
        f"{DYN}::test_use_agent_store_is_disabled", agent_store_disabled, cost=3,
    ),
    # run_test.py
    Scenario(
        "launch-line", "--nnodes=1:2, c10d's --rdzv-conf keys unchanged: exit 0, every rank, torch's env",
        f"{RUN}::test_launch_elastic", launch_line_unchanged, cost=4,
    ),
    Scenario(
        "worker-raises", "a worker raises: exit 1, its error in the launcher's error file",
        f"{RUN}::test_launch_elastic_worker_raise_exception", worker_raises, cost=12,
    ),
    Scenario(
        "agent-raises", "the agent raises: the launcher re-raises it",
        f"{RUN}::test_launch_elastic_agent_raise_exception", agent_raises, cost=2,
    ),
    # local_elastic_agent_test.py
    Scenario(
        "restart", "--max-restarts: a failed worker group is restarted and succeeds",
        f"{LEA}::test_rank_restart_after_failure", restart_recovers, cost=5,
    ),
    Scenario(
        "restarts-spent", "--max-restarts spent: exit 1 after max_restarts + 1 attempts",
        f"{LEA}::test_run_bipolar_function_c10d", restarts_exhausted, cost=6,
    ),
    Scenario(
        "two-agents", "two agents (1 and 2 workers): ranks 0..2, consecutive per agent",
        f"{LEA}::test_run_distributed_sum_heterogeneous_c10d", ranks_of_two_agents, cost=4,
    ),
    Scenario(
        "gloo-sum", "two agents' workers form a gloo group and all-reduce",
        f"{LEA}::test_run_distributed_sum_homogeneous_c10d", gloo_sum, cost=14,
    ),
    Scenario(
        "fault-tolerance", "one agent killed, a new one started: a new round, both exit 0",
        f"{LEA}::test_double_agent_fault_tolerance_etcd", fault_tolerance, cost=12,
    ),
    Scenario(
        "elastic", "one agent of two killed: the other re-forms alone and exits 0",
        f"{LEA}::test_double_agent_elastic_c10d", elastic_scale_down, cost=10,
    ),
    Scenario(
        "takes-over", "a node waiting beyond max takes a killed member's place",
        f"{DYN}::test_redundancy_transition_to_wait_list_then_join_rendezvous", waiting_node_takes_over, cost=14,
    ),
    Scenario(
        "drift-success", "workers finish apart, within the exit barrier: both pass it",
        f"{LEA}::test_workers_drift_success_etcd", drift_success, cost=5,
    ),
    Scenario(
        "drift-fail", "workers finish apart, exit barrier timeout 0: both exit 0, no restart",
        f"{LEA}::test_workers_drift_fail_etcd", drift_fail, cost=5,
    ),
    Scenario(
        "barrier-fails", "a failing exit barrier does not fail the job",
        f"{LEA}::test_barrier_failed_c10d", barrier_failure, cost=2,
    ),
    Scenario(
        "no-barrier", "failed workers skip the exit barrier: both agents exit non-zero",
        f"{LEA}::test_no_exit_barrier_on_failure", no_barrier_on_failure, cost=4,
    ),
    # etcd-v3's own: agents sharing a host need a name each
    Scenario(
        "duplicate-name", "two live agents under one NODE_NAME: the second is refused (DuplicateNode)",
        "(etcd-v3: one node name per live agent)", duplicate_node_name, backends=("etcd-v3",), cost=6,
    ),
]


NOT_APPLICABLE = {
    "shutdown": (
        "by design etcd-v3's shutdown() closes the run only once the job is over: the agent's "
        "workers succeeded (it entered torchrun's exit barrier, as in the drift scenarios) or no "
        "round formed; an agent that fails leaves alone and the others re-form, where c10d's "
        "closing would end the elastic job for every survivor and every later pod"
    ),
    "lost-queries": (
        "by design etcd-v3 answers both from its watch's view of the job, without a request, so "
        "training rides out an etcd restart (see Failure behaviour); c10d's agents, whose monitor "
        "loop calls num_nodes_waiting(), fail when their store does"
    ),
    "agent-store": (
        "by design etcd-v3 has no agent store (use_agent_store is False): each round's store "
        "lives in etcd and workers bootstrap from a fresh MASTER_ADDR/PORT, as with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (gloo-sum shows it works)"
    ),
}
"""Scenarios c10d passes that etcd-v3 need not: the reason, shown in the table."""


_PYTORCH_135712 = (
    "pytorch#135712: with the shared agent store (c10d's default) a node that joins a running job "
    "and is not rank 0 waits for a MASTER_ADDR that rank 0, keeping its first round's, never writes again"
)
C10D_KNOWN_FAILURES = {
    "num-waiting": _PYTORCH_135712,
    "fault-tolerance": _PYTORCH_135712,
    "takes-over": _PYTORCH_135712,
    "close-timeout": (
        "c10d's TCPStore compare_set has no timeout: set_closed() blocks on a stalled store past close_timeout"
    ),
}
"""Scenarios c10d fails through a known torch bug: etcd-v3 must pass them all the same."""
