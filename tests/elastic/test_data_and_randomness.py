"""Data order and randomness that do not depend on the world size (``elastic.Sampler``,
keyed dropout, the RNG of each step and of each call), checked in this process without a
world: the multi-process proof is the minGPT example's run through a kill, a grow and a
planned shrink (tests/examples/test_reforms.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from regroup.elastic.world.batching import plan_batches
from regroup.elastic import Dropout, MisuseError, Sampler, dropout, generator, keyed_dropout, samples
from regroup.elastic.data import Span, fit_batches, sampler_of
from regroup.elastic.randomness import StartState, keyed_uniform, seed_step, set_seed
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _keep_rng() -> Iterator[None]:
    """These tests seed the process's generators; leave them as they were."""
    state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(state[0])
    random.setstate(state[1])


def _step_indices(sampler: Sampler, global_batch: int, world_size: int, step: int, micro: int = 0) -> list[int]:
    """Dataset indices of ``step`` over all ranks of a world, rank after rank."""
    per_epoch = sampler.steps_per_epoch(global_batch)
    out: list[int] = []
    for rank in range(world_size):
        plan = plan_batches(global_batch, world_size, rank, micro)
        for indices, _ in sampler.batches(Span(plan, step, step + 1, per_epoch)):
            out += indices
    return out


def test_every_world_size_trains_the_same_samples_in_each_step_and_each_epoch_is_a_permutation() -> None:
    sampler = Sampler(50, seed=7)
    assert sampler.steps_per_epoch(12) == 4  # 48 of 50 samples an epoch: the remainder is left out
    for step in range(12):
        alone = _step_indices(sampler, 12, 1, step)
        assert len(alone) == 12
        for size in (2, 3, 4, 6, 12):
            assert _step_indices(sampler, 12, size, step) == alone, (size, step)
            assert _step_indices(sampler, 12, size, step, micro=1) == alone, "micro-batches change nothing"
    epochs = [[i for s in range(e * 4, e * 4 + 4) for i in _step_indices(sampler, 12, 1, s)] for e in range(3)]
    for epoch in epochs:
        assert len(set(epoch)) == 48 and set(epoch) <= set(range(50))
    assert epochs[0] != epochs[1] != epochs[2], "each epoch is shuffled anew"
    assert Sampler(50, seed=8).order(0).tolist() != sampler.order(0).tolist(), "the seed decides the order"
    assert Sampler(50, shuffle=False).order(3).tolist() == list(range(50))


def test_a_loader_with_workers_loads_a_ranks_micro_batches_from_any_step() -> None:
    """Resuming mid-epoch (step 5 of 4-step epochs) at another world size: the loader's
    batches are this rank's micro-batches of the very next steps, through worker processes."""
    dataset = TensorDataset(torch.arange(50))
    sampler = Sampler(dataset, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    plan = plan_batches(12, 3, 1, max_micro_batch=loader.batch_size)  # share 4: one micro-batch
    sampler.cover(Span(plan, 5, 8, sampler.steps_per_epoch(12)))
    fit_batches(loader, plan.micro_batch)
    assert len(loader) == 3
    got = [batch.tolist() for (batch,) in loader]
    want = [_step_indices(sampler, 12, 3, step)[4:8] for step in (5, 6, 7)]
    assert got == want
    plan = plan_batches(12, 1, 0, max_micro_batch=5)  # share 12 in micro-batches of 4
    sampler.cover(Span(plan, 7, 8, 4))
    fit_batches(loader, plan.micro_batch)
    assert [batch.tolist() for (batch,) in loader] == [
        _step_indices(sampler, 12, 1, 7)[i : i + 4] for i in (0, 4, 8)
    ]


def test_outside_the_run_a_sampler_yields_this_ranks_part_for_an_evaluation_pass() -> None:
    sampler = Sampler(10)
    sampler.set_epoch(3)  # DistributedSampler's call is accepted
    assert list(sampler) == list(range(10)) and len(sampler) == 10  # a world of one: everything


def test_misuse_says_what_to_do() -> None:
    with pytest.raises(MisuseError, match="empty"):
        Sampler([])
    with pytest.raises(MisuseError, match="fewer than one global batch"):
        Sampler(10).steps_per_epoch(16)
    dataset = TensorDataset(torch.arange(8))
    with pytest.raises(MisuseError, match="elastic.Sampler"):
        sampler_of(DataLoader(dataset, batch_size=2))
    with pytest.raises(MisuseError, match="make batches"):
        sampler_of(DataLoader(dataset, batch_size=None, sampler=Sampler(dataset)))


def test_keyed_dropout_gives_a_sample_its_mask_whoever_trains_it() -> None:
    """The same sample gets the same mask in a batch of 8 and in a batch of 2 (another world
    size's share), per layer name; ordinary dropout outside a step; a mismatch is named."""
    set_seed(11)
    x = torch.ones(8, 3, 5)
    with samples(range(100, 108)):
        whole = dropout(x, 0.5, "block.0")
        other_layer = dropout(x, 0.5, "block.1")
    with samples(range(104, 106)):
        part = dropout(x[4:6], 0.5, "block.0")
    assert torch.equal(whole[4:6], part)
    assert not torch.equal(whole, other_layer)
    kept = (whole != 0).float().mean().item()
    assert 0.4 < kept < 0.6 and set(whole.unique().tolist()) == {0.0, 2.0}
    with samples(range(3)), pytest.raises(RuntimeError, match="no batch dimension of the 3 samples"):
        dropout(x, 0.5, "block.0")
    assert dropout(x, 0.5, "block.0", training=False) is x
    set_seed(12)
    with samples(range(100, 108)):
        assert not torch.equal(dropout(x, 0.5, "block.0"), whole), "the run's seed decides the masks"


def test_keyed_dropout_replaces_every_dropout_module_by_its_path() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Sequential(nn.Dropout(0.3)))
    assert keyed_dropout(model) is model
    found = [(m.name, m.p) for m in model.modules() if isinstance(m, Dropout)]
    assert found == [("1", 0.2), ("2.0", 0.3)]


def test_keyed_uniforms_are_uniform_and_a_function_of_key_and_column() -> None:
    u = keyed_uniform([1, 2, 1], 20_000)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01
    set_seed(5)
    assert torch.equal(torch.rand(3, generator=generator(9, 1)), torch.rand(3, generator=generator(9, 1)))
    assert not torch.equal(torch.rand(3, generator=generator(9, 1)), torch.rand(3, generator=generator(9, 2)))


def test_a_steps_rng_is_a_function_of_seed_step_and_rank_and_each_call_starts_alike() -> None:
    seed_step(1, 10, 0)
    first = torch.rand(2), random.random()
    torch.rand(5)
    seed_step(1, 10, 0)
    assert torch.equal(torch.rand(2), first[0]) and random.random() == first[1]
    seed_step(1, 11, 0)
    assert not torch.equal(torch.rand(2), first[0]), "steps draw apart"
    seed_step(1, 10, 1)
    assert not torch.equal(torch.rand(2), first[0]), "ranks draw apart"
    start = StartState.capture(42)
    draws = torch.randperm(10), random.random()
    torch.rand(100)
    random.random()
    start.restore()
    assert torch.equal(torch.randperm(10), draws[0]) and random.random() == draws[1]


DOCS = REPO / "docs" / "your-script.md"
TEMPLATE = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from regroup import elastic


@elastic.in_place
def main(epochs=2, seed=0, batch_size=16, global_batch=16):
    device = elastic.world().device
    dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{converted}
    print("trained", run.step, flush=True)


main()
'''


def test_the_documented_loader_loop_converts_in_five_lines_and_runs(tmp_path: Path, worker_env: dict[str, str]) -> None:
    """docs/your-script.md's diff of an epochs + DataLoader + DistributedSampler loop: at
    most five changed lines, and the converted lines train (a world of one, two epochs of
    four steps, two loader workers)."""
    text = DOCS.read_text()
    marker = text.index("<!-- the loader diff")
    block = text[text.index("```diff\n", marker) + len("```diff\n") : text.index("```", text.index("```diff\n", marker) + 7)]
    lines = block.splitlines()
    added = [line[1:] for line in lines if line.startswith("+")]
    assert len(added) <= 5 and sum(1 for line in lines if line.startswith("-")) <= len(added), block
    converted = "\n".join(line[1:] for line in lines if not line.startswith("-"))
    path = tmp_path / "train.py"
    path.write_text(TEMPLATE.format(converted=converted))
    result = subprocess.run([sys.executable, str(path)], env=worker_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 8" in result.stdout, result.stdout


class _WhoLoads(torch.utils.data.Dataset):
    """Sample ``i`` is ``(i, the PID of the process that loaded it)``."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, os.getpid()


def test_a_loader_built_once_keeps_its_workers_across_a_re_form() -> None:
    """A loader outside the training function, ``persistent_workers=True``: a pass left
    mid-way (a re-form) and the next world's pass, at another size and step, load exactly
    that world's batches (none of the first pass's prefetched ones) in the same worker."""
    dataset = _WhoLoads()
    sampler = Sampler(dataset, seed=5)
    loader = DataLoader(dataset, batch_size=6, sampler=sampler, num_workers=1, persistent_workers=True)
    plan = plan_batches(12, 2, 0, max_micro_batch=6)
    sampler.cover(Span(plan, 0, 4, 4))
    fit_batches(loader, plan.micro_batch)
    first = iter(loader)
    indices, pids = next(first)
    assert indices.tolist() == _step_indices(sampler, 12, 2, 0)[:6]
    sampler.cover(None)  # the world ends here, with batches of the first pass prefetched
    plan = plan_batches(12, 3, 2, max_micro_batch=6)  # the next world: 3 ranks, from step 2
    sampler.cover(Span(plan, 2, 4, 4))
    fit_batches(loader, plan.micro_batch)
    got = list(loader)
    assert [i.tolist() for i, _ in got] == [_step_indices(sampler, 12, 3, step)[8:12] for step in (2, 3)]
    assert {p for _, ps in got for p in ps.tolist()} == set(pids.tolist()), "the worker was started anew"
