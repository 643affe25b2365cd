"""Every path that moves training state, at hundreds of MB, for FSDP2 and for DDP.

Three real processes on gloo run the chain of ``bench.scale.chain`` once per wrapper: a
node lost and replaced by a fresh process at the same size (snapshots and buddy copies),
lost again and the world shrinks (snapshots), a grow at an agreed boundary (live state),
a planned leave migrated to a fresh process (hand-off at the boundary) and one that
shrinks the world (the leaving rank's snapshots secured with the staying ranks first, as at
a planned shrink's ack), then a DCP checkpoint saved and loaded by fresh processes. The model is the
trainer's Llama-style decoder with about 27M parameters: 321 MB of model + AdamW state in
all (FSDP2: a third on each rank; DDP: all of it on each rank).

After every path, on every rank: each model and optimizer tensor's storage is its own
bytes (no view of a snapshot buffer or of a message keeps more alive), the state is the
one the old world left, the process holds the new world's state and nothing of the old,
and the re-form's peak stayed within what docs/trainer.md ("Host memory") states.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.scale.launch import run_chain
from bench.scale.report import chart, render, summarize
from regroup.elastic.memory.handoff import securing_load
from tests.scratch import scratch

MODEL = {"vocab_size": 1000, "dim": 512, "n_layers": 8, "n_heads": 4, "seq_len": 16}
BUCKET = 8 << 20
"""Message budget for the run (``reshard.BUCKET_BYTES``): the transient bound is 2x this."""
PROCS = 3
PATHS = ["replace", "shrink-loss", "grow", "migrate", "shrink-planned", "load"]

Records = list[list[dict[str, Any]]]


@pytest.fixture(scope="module", params=["fsdp", "ddp"])
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Records]:
    with scratch(request, tmp_path_factory, f"state-sizes-{request.param}") as root:
        spec = {
            "wrap": request.param,
            "model": MODEL,
            "checkpoint_dir": str(root / "checkpoints"),
            "bucket_bytes": BUCKET,
            "steady_steps": 1,
        }
        yield run_chain(spec, PROCS, root / "out", timeout=600)


def _members(chain: Records, path: str) -> list[dict[str, Any]]:
    found = [r for records in chain for r in records if r["path"] == path and r["member"]]
    assert found, f"no process took part in {path}"
    return found


def test_the_state_is_hundreds_of_megabytes(chain: Records) -> None:
    start = _members(chain, "start")
    job_state = sum(r["share_bytes"] for r in start)
    assert 300e6 < job_state < 350e6, job_state
    assert [r["path"] for r in chain[0]] == ["start", *PATHS]


def test_every_tensor_after_every_path_is_its_own_memory(chain: Records) -> None:
    for path in PATHS:
        for record in _members(chain, path):
            storage = record["storage"]
            assert storage["worst_ratio"] == 1.0, (path, storage)
            assert storage["storages"] == storage["tensors"], (path, storage)


def test_every_path_lands_on_the_state_the_old_world_left(chain: Records) -> None:
    for path in PATHS:
        members = _members(chain, path)
        assert len({r["step"] for r in members}) == 1 and members[0]["step"] > 0, (path, members)
        # A process that was out of the old world has no digest of it to compare with.
        assert {r["digest_ok"] for r in members} <= {True, None}, path
        assert any(r["digest_ok"] for r in members), path
    sizes = {path: _members(chain, path)[0]["world"] for path in PATHS}
    assert sizes == {"replace": 3, "shrink-loss": 2, "grow": 3, "migrate": 3, "shrink-planned": 2, "load": 3}


def test_at_the_same_size_a_newcomer_receives_its_state_and_a_survivor_only_what_it_lacks(chain: Records) -> None:
    for path in ("replace", "migrate"):
        members = _members(chain, path)  # one per process, in order: the last is the newcomer
        *survivors, newcomer = members
        assert newcomer["received_bytes"] >= 0.99 * newcomer["state_bytes"], path
        for survivor in survivors:
            state, received = survivor["state_bytes"], survivor["received_bytes"]
            if path == "migrate":  # an agreed boundary: a survivor's live state is whole
                assert received == 0, (path, received)
            elif survivor["share_bytes"] < state:
                # DDP from snapshots: the replicated state was kept once per job, a chunk on each
                # rank and one on its buddy; a survivor gathers the chunks it does not hold.
                assert received <= 0.34 * state, (path, received)
            else:  # FSDP2 from snapshots: its own shards are in its snapshot; AdamW's steps are not
                assert received <= 0.01 * state, (path, received)


def test_after_a_re_form_the_process_holds_the_new_state_and_nothing_of_the_old(chain: Records) -> None:
    for records in chain:
        baseline = records[0]["extra"]["baseline_rss"]
        for record in records[1:]:
            if not record["member"]:
                continue
            state = record["state_bytes"]
            # The old model, optimizer, snapshot buffers and messages are gone: what live
            # tensors hold is the new state (FSDP2 pads a shard to ceil(rows / world) rows).
            assert record["live_tensor_bytes"] <= 1.01 * state + (1 << 20), record
            # And the heap gave the freed pages back (``host_memory.give_back``).
            assert record["after_rss"] - baseline <= 3 * state + (64 << 20), record


def test_a_re_form_peaks_within_what_the_docs_state(chain: Records) -> None:
    """docs/trainer.md: a re-form adds to the steady state (with snapshots) at most the new
    world's state, the shards handed to this rank and two message buffers; in all at most
    1.5x the steady state."""
    for records in chain:
        steady = records[0]["peak_rss"]
        handed = max((r["extra"].get("handoff_bytes", 0) for rs in chain for r in rs), default=0)
        for record in records[1:]:
            if not record["member"]:
                continue
            extra = record["peak_rss"] - steady
            bound = record["state_bytes"] + (handed if record["path"] in ("migrate", "shrink-planned") else 0)
            assert extra <= bound + 2 * BUCKET + 0.1 * steady, (record["path"], extra, bound)
            assert record["peak_rss"] <= 1.5 * steady, record["path"]


def test_a_planned_shrink_secures_the_leaving_ranks_snapshots_within_the_stated_load(chain: Records) -> None:
    """docs/trainer.md ("Host memory"): before a planned shrink's ack the leaving rank sends
    its snapshot and its copy of its sender's to the staying ranks; each keeper receives at
    most ``securing_load`` snapshot shares, and between them they receive all it sent."""
    share = chain[0][0]["extra"]["snapshot_bytes"]  # a rank's own copy of one generation (U)
    members = _members(chain, "shrink-planned")
    received = [r["extra"]["secured_received_bytes"] for r in members]
    sent = max(r["extra"].get("handoff_bytes", 0) for rs in chain for r in rs if r["path"] == "shrink-planned")
    assert sent > 0 and sum(received) == sent, (received, sent)
    assert max(received) <= securing_load(1, len(members)) * share * 1.01 + (1 << 20), (received, share)


def test_the_benchmark_reads_the_run_into_one_row_per_size_with_every_path(chain: Records, tmp_path: Path) -> None:
    wrap = "ddp" if chain[0][0]["share_bytes"] < 0.9 * chain[0][0]["state_bytes"] else "fsdp"
    row = summarize(wrap, "27M", 27_000_000, chain)
    assert set(row["paths"]) == set(PATHS) - {"load"} and row["dcp"]["bytes"] > 300e6
    assert row["snapshot"]["host_x_state"] == pytest.approx(4.0 if wrap == "fsdp" else 4 / PROCS, rel=0.01)
    assert all(p["worst_storage_ratio"] == 1.0 for p in row["paths"].values())
    table = render([row], ["a size left out"], "a machine")
    assert all(f"| {wrap} | 27M | {path} |" in table for path in row["paths"]) and "- a size left out" in table
    chart([row], tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 10_000
