"""Randomness that survives a re-form.

Three rules, each a pure function of facts every rank agrees on:

- **Every call of the training function starts from the same RNG state** (Python's
  ``random``, NumPy's global generator, torch's CPU and CUDA generators), all seeded with
  one seed (``in_place(seed=...)``). A survivor's second call and a newcomer's first draw
  the same start-up values (``random_split``, initial weights), on every rank.
- **A rank's RNG at the start of step ``s`` is a function of (seed, s, rank)**: set at every
  step. A checkpoint or snapshot restores the step, and with it the RNG of every rank, so
  a run resumed at the same world size draws exactly what the uninterrupted one drew.
- **Randomness keyed by global sample id** (``Dropout``, ``keyed_dropout``, ``generator``)
  does not depend on the world size at all: a sample's dropout mask is a function of
  (seed, sample id, layer), whichever rank trains it.

A keyed draw comes from a generator of its own seeded with SplitMix64 of (seed, sample id,
layer): nothing else in the process changes it (CPU and CUDA generators draw differently,
so a job keeps its device type).
"""

from __future__ import annotations

import contextlib
import random
import sys
import zlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def mix(*parts: int) -> int:
    """SplitMix64 over ``parts``: a well-spread 64-bit value (unsigned) of small integers."""
    z = 0
    for part in parts:
        z = (z + (part & _MASK64) + _GOLDEN) & _MASK64
        z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
        z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
        z ^= z >> 31
    return z


def keyed_uniform(keys: Sequence[int], count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(keys), count]`` float32 uniforms in [0, 1) on ``device``: row ``i`` is drawn
    from a generator of its own seeded with ``keys[i]``, so it depends on nothing else (one
    generator per row: faster on CPU than hashing every element, and as many kernels as
    rows on CUDA)."""
    out = torch.empty(len(keys), count, device=device)
    for row, key in zip(out, keys, strict=True):
        generator = torch.Generator(device=out.device)
        generator.manual_seed(key)
        row.uniform_(generator=generator)
    return out


# --- the run's seed and the samples being trained ---------------------------------------


@dataclass(frozen=True)
class Keys:
    """What keyed randomness is a function of: the run's seed and the global ids of the
    samples in the batch being trained (rows of the batch, in order)."""

    seed: int
    samples: torch.Tensor | None = None


_keys: ContextVar[Keys] = ContextVar("regroup_random_keys", default=Keys(seed=0))


def current_keys() -> Keys:
    return _keys.get()


def set_seed(seed: int) -> None:
    """The run's seed (agreed by every rank), for keyed randomness in this process."""
    _keys.set(Keys(seed=seed))


@contextlib.contextmanager
def samples(ids: Sequence[int] | range | torch.Tensor) -> Iterator[None]:
    """Keyed randomness inside this block belongs to these global sample ids (the batch's
    rows, in order). The run sets it for each micro-batch it hands out; use it for data the
    script cuts itself."""
    tensor = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(list(ids), dtype=torch.int64)
    token = _keys.set(Keys(seed=_keys.get().seed, samples=tensor))
    try:
        yield
    finally:
        _keys.reset(token)


def enter_samples(ids: Sequence[int] | range | torch.Tensor | None) -> None:
    """Set the samples until the next call (the run's micro-batches follow one another;
    None when a step ends)."""
    tensor = None if ids is None else torch.as_tensor(list(ids), dtype=torch.int64)
    _keys.set(Keys(seed=_keys.get().seed, samples=tensor))


def generator(*key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded by the run's seed and ``key`` (a global sample id, and
    whatever else tells draws apart): the same on every rank and at every world size, for
    augmentation or noise that must not depend on who trains the sample."""
    gen = torch.Generator(device=device)
    gen.manual_seed(mix(_keys.get().seed, *key) >> 1)
    return gen


def dropout(x: torch.Tensor, p: float, name: str, training: bool = True) -> torch.Tensor:
    """``F.dropout`` whose mask for each sample is a function of (seed, sample id, ``name``):
    the batch's rows are the samples the run hands out (``samples``), in order. Outside a
    step (an evaluation pass left in training mode) it is ``F.dropout``."""
    keys = _keys.get()
    if not training or p == 0.0 or p == 1.0 or keys.samples is None:
        return torch.nn.functional.dropout(x, p, training)
    rows = len(keys.samples)
    if x.dim() == 0 or x.numel() % rows or (x.shape[0] % rows and x.shape[0] != rows):
        raise RuntimeError(
            f"keyed dropout: the tensor's shape {tuple(x.shape)} has no batch dimension of the "
            f"{rows} samples being trained (first dimension, batch-major)"
        )
    salt = zlib.crc32(name.encode())
    row_keys = [mix(keys.seed, sample, salt) >> 1 for sample in keys.samples.tolist()]
    keep = keyed_uniform(row_keys, x.numel() // rows, x.device) >= p
    return x * keep.view(x.shape).to(x.dtype).mul_(1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """``nn.Dropout`` keyed by sample: a sample's mask does not depend on the rank or the
    world size that trains it. ``name`` tells the layers apart (``keyed_dropout`` uses the
    module's path in the model)."""

    def __init__(self, p: float = 0.5, name: str = "dropout") -> None:
        super().__init__(p)
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.name, self.training)


def keyed_dropout(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Dropout`` in ``model`` by a keyed ``Dropout`` of the same ``p``,
    named by its path in the model. Returns the model (changed in place)."""
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                full = f"{path}.{child_name}" if path else child_name
                setattr(module, child_name, Dropout(child.p, full))
    return model


# --- the process's RNG: each call's start, each step's state -------------------------------


START_SEED = 67280421310721
"""The seed every call of the training function starts from unless ``in_place(seed=...)``
says otherwise (torch's own default seed of old: a fresh process's generator now draws a
seed of its own, which differs between ranks)."""


@dataclass(frozen=True)
class StartState:
    """The RNG state a call of the training function starts from."""

    python: Any
    torch_cpu: torch.Tensor
    numpy: Any = None
    cuda_seed: int | None = None

    @classmethod
    def capture(cls, seed: int) -> StartState:
        """Every generator of the process seeded with ``seed``, as each call starts from it."""
        torch.manual_seed(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        numpy_state = None
        if numpy is not None:
            numpy.random.seed(seed % (1 << 32))
            numpy_state = numpy.random.get_state()
        return cls(
            python=random.getstate(),
            torch_cpu=torch.get_rng_state(),
            numpy=numpy_state,
            cuda_seed=seed if torch.cuda.is_available() else None,
        )

    def restore(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.torch_cpu)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if self.numpy is not None:
                numpy.random.set_state(self.numpy)
            else:  # imported since the capture
                numpy.random.seed(torch.initial_seed() % (1 << 32))
        if self.cuda_seed is not None:
            torch.cuda.manual_seed_all(self.cuda_seed)


def seed_step(seed: int, step: int, rank: int) -> None:
    """The RNG of ``rank`` at the start of ``step``: torch (CPU and every CUDA device),
    Python's ``random`` and NumPy's global generator, from (seed, step, rank)."""
    value = mix(seed, step, rank)
    torch.manual_seed(value >> 1)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (1 << 32))
