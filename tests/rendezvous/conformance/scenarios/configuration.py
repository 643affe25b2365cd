"""What a handler says of itself and takes from its configuration
(``dynamic_rendezvous_test.py``): its run id and backend, ``local_addr`` as the master
address, the agent store on by default and off with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from tests.rendezvous.conformance.scenario_run import Run


def identity(run: Run) -> None:
    a = run.handler((1, 2))
    assert a.get_run_id() == run.run_id, a.get_run_id()
    assert a.get_backend() == run.backend.name, a.get_backend()


def local_addr(run: Run) -> None:
    a = run.handler((1, 1), local_addr="127.0.0.2")
    [info] = run.join(a)
    assert info.bootstrap_store_info is not None
    assert info.bootstrap_store_info.master_addr == "127.0.0.2", info.bootstrap_store_info


def agent_store_default(run: Run) -> None:
    a = run.handler((1, 2))
    assert a.use_agent_store is True, f"use_agent_store is {a.use_agent_store!r}"


def report_use_agent_store(backend: str, endpoint: str, run_id: str, conf: dict[str, str], result: str) -> None:
    """In a child whose environment says ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    params = RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1, local_addr="127.0.0.1", **conf
    )
    handler = get_rendezvous_handler(params)
    try:
        Path(result).write_text(json.dumps({"use_agent_store": handler.use_agent_store}))
    finally:
        handler.shutdown()


def agent_store_disabled(run: Run) -> None:
    result = run.out / "use_agent_store.json"
    request = {
        "kind": "call",
        "env": {**run.env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        "log": str(run.out / "call.log"),
        "target": "tests.rendezvous.conformance.scenarios.configuration:report_use_agent_store",
        "kwargs": {
            "backend": run.backend.name,
            "endpoint": run.backend.endpoint(run),
            "run_id": run.run_id,
            "conf": run.backend.conf(run, 0, True),
            "result": str(result),
        },
    }
    child = run.children.spawn(request)
    code = run.children.exit_code(child, 30)
    assert code == 0, f"the child exited {code}: {(run.out / 'call.log').read_text(errors='replace')[-2000:]}"
    value = json.loads(result.read_text())["use_agent_store"]
    assert value is False, f"use_agent_store is {value!r} with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
