"""Config validation, batch splitting, the data order and the request decision: pure parts."""

from __future__ import annotations

import array
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from regroup.records import CheckpointRequest
from regroup.elastic.world.batching import BatchSplitError, plan_batches
from regroup.elastic.settings import ConfigError
from regroup.trainer.config_loading import config_from_dict, load_config
from regroup.elastic.world.control import pending_generation
from regroup.trainer.data import SyntheticTokens, TokenFile
from regroup.trainer.schedule import lr_at


def test_config_file_overrides_and_env_fill_the_tree(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("batch: {global_batch_size: 24}\ncheckpoint: {dir: /ckpt, every: 2m}\netcd: {}\n")
    env = {"REGROUP_ETCD_ENDPOINT": "etcd-0.etcd:2379", "TORCHELASTIC_RUN_ID": "llama", "POD_NAMESPACE": "team-a"}
    cfg = load_config(path, ["max_steps=7", "checkpoint.async_save=false"], env)
    assert cfg.batch.global_batch_size == 24
    assert cfg.checkpoint.every == timedelta(minutes=2)
    assert cfg.checkpoint.async_save is False
    assert cfg.max_steps == 7
    assert cfg.etcd is not None
    assert (cfg.etcd.endpoint, cfg.etcd.job, cfg.etcd.namespace) == ("etcd-0.etcd:2379", "llama", "team-a")
    assert config_from_dict({}).etcd is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"batch": {"global_batch_size": 0}}, "batch.global_batch_size: must be >= 1"),
        ({"model": {"dim": 100, "n_heads": 3}}, "model.dim: 100 must divide by model.n_heads=3"),
        ({"model": {"dimm": 1}}, "model.dimm: unknown field"),
        ({"checkpoint": {"every": "soon"}}, "checkpoint.every: expected a duration"),
        ({"checkpoint": {"async_save": "yes"}}, "checkpoint.async_save: expected true or false"),
        ({"data": {"source": "file"}}, "data.path: required"),
        ({"data": {"dtype": "int8"}}, "data.dtype: must be one of"),
        ({"etcd": {"job": "j"}}, "etcd.endpoint: required"),
        ({"faults": [{"kind": "crash", "rank": 0}]}, "faults[0]"),
    ],
)
def test_bad_config_names_the_field(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(data)


def test_global_batch_split_adapts_to_world_size() -> None:
    for world in (1, 2, 3, 4, 6, 12):
        plans = [plan_batches(12, world, rank, max_micro_batch=2) for rank in range(world)]
        ids = sorted(i for plan in plans for i in plan.step_ids(5))
        assert ids == list(range(60, 72))
        assert all(p.micro_batch <= 2 and p.micro_batch * p.accumulation == 12 // world for p in plans)
    with pytest.raises(BatchSplitError, match="world sizes that work: 1, 2, 3, 4, 6, 12"):
        plan_batches(12, 5, 0)


def test_synthetic_samples_depend_on_index_and_seed_only() -> None:
    a, b = SyntheticTokens(256, 32, seed=1), SyntheticTokens(256, 32, seed=1)
    assert torch.equal(a.sample(1234), b.sample(1234))
    assert not torch.equal(a.sample(1234), a.sample(1235))
    assert not torch.equal(a.sample(7), SyntheticTokens(256, 32, seed=2).sample(7))
    assert a.sample(3).shape == (33,)


def test_token_file_visits_every_window_once_per_epoch(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    path.write_bytes(array.array("H", range(8 * 10 + 1)).tobytes())
    source = TokenFile(path, "uint16", seq_len=8, vocab_size=1000, seed=3, shuffle=True)
    starts = [int(source.sample(i)[0]) for i in range(10)]
    assert sorted(starts) == [8 * w for w in range(10)]
    assert starts != sorted(starts)
    again = TokenFile(path, "uint16", seq_len=8, vocab_size=1000, seed=3, shuffle=True)
    assert [int(again.sample(i)[0]) for i in range(10, 20)] != starts  # a fresh permutation per epoch
    with pytest.raises(ValueError, match="model.vocab_size"):
        TokenFile(path, "uint16", seq_len=8, vocab_size=50, seed=3, shuffle=False).sample(9)
    wide = tmp_path / "tokens32.bin"
    wide.write_bytes(array.array("I", [70_000 + i for i in range(17)]).tobytes())
    with pytest.raises(ValueError, match="not a whole number of uint32 tokens"):
        TokenFile(path, "uint32", seq_len=8, vocab_size=1000, seed=0, shuffle=False)  # 81 uint16 = 162 bytes
    second_window = TokenFile(wide, "uint32", 8, 100_000, seed=0, shuffle=False).sample(1)
    assert second_window.tolist() == list(range(70_008, 70_017))


def test_checkpoint_request_is_honoured_once_and_not_after_its_deadline() -> None:
    request = CheckpointRequest(generation=4, deadline=100.0)
    assert pending_generation(None, 50.0, answered=0) == 0
    assert pending_generation(request, 50.0, answered=3) == 4
    assert pending_generation(request, 50.0, answered=4) == 0
    assert pending_generation(request, 100.0, answered=0) == 0


def test_a_request_whose_plan_asked_for_the_re_form_is_never_honoured() -> None:
    """A plan that fell back to the unplanned path re-formed without its checkpoint: the
    survivors of that re-form must not save and hold on the request it left behind."""
    request = CheckpointRequest(generation=5, deadline=100.0)
    assert pending_generation(request, 50.0, answered=4, reformed=4) == 5
    assert pending_generation(request, 50.0, answered=4, reformed=5) == 0
    assert pending_generation(request, 50.0, answered=0, reformed=7) == 0


def test_lr_schedule_is_a_function_of_the_step() -> None:
    cfg = config_from_dict({"optim": {"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1}})
    assert [lr_at(s, cfg.optim, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(19, cfg.optim, 20) == pytest.approx(0.1, abs=0.02)
    assert lr_at(100, cfg.optim, 20) == pytest.approx(0.1)
