"""Token sources where sample ``i`` is a function of ``i`` (and a seed) only.

That is what makes resizes invisible to the data: any rank of any world size can
produce any sample, so a resumed run needs nothing but the step it resumes at.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from regroup.trainer.config import DataConfig, ModelConfig

_MASK64 = (1 << 64) - 1
_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


def _mix(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit generator seed per sample."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class TokenSource(Protocol):
    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index`` as ``seq_len + 1`` token ids (inputs and shifted targets)."""
        ...


class SyntheticTokens:
    """Arithmetic progressions modulo the vocabulary with a per-sample stride and a little
    noise: deterministic, and learnable (the stride must be read from the context)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, noise: float = 0.05) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.noise = noise

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_mix(self.seed, index))
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        stride = int(torch.randint(1, 8, (1,), generator=generator))
        positions = torch.arange(self.seq_len + 1, dtype=torch.int64)
        tokens = (start + stride * positions) % self.vocab_size
        noisy = torch.rand(self.seq_len + 1, generator=generator) < self.noise
        random_tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
        return torch.where(noisy, random_tokens, tokens)


class TokenFile:
    """A flat memory-mapped array of token ids cut into ``seq_len + 1`` windows (stride
    ``seq_len``), visited in a seeded per-epoch permutation."""

    def __init__(self, path: str | Path, dtype: str, seq_len: int, vocab_size: int, seed: int, shuffle: bool) -> None:
        itemsize = _DTYPES[dtype].itemsize
        size = Path(path).stat().st_size
        if size < (seq_len + 1) * itemsize or size % itemsize:
            raise ValueError(
                f"data.path: {path} has {size} bytes: not a whole number of {dtype} tokens, "
                f"or fewer than seq_len+1={seq_len + 1} of them"
            )
        with open(path, "rb") as file:
            # A private (copy-on-write) mapping: torch wants a writable buffer, nothing is copied.
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tokens = torch.frombuffer(self._map, dtype=_DTYPES[dtype])
        self.seq_len = seq_len
        self.windows = (len(self.tokens) - 1) // seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._order: torch.Tensor | None = None

    def _window(self, index: int) -> int:
        epoch, offset = divmod(index, self.windows)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(_mix(self.seed, epoch))
            self._order = torch.randperm(self.windows, generator=generator)
            self._epoch = epoch
        assert self._order is not None
        return int(self._order[offset])

    def sample(self, index: int) -> torch.Tensor:
        start = self._window(index) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].to(torch.int64)
        if int(window.max()) >= self.vocab_size:
            raise ValueError(f"data.path: token id {int(window.max())} >= model.vocab_size={self.vocab_size}")
        return window


def make_source(data: DataConfig, model: ModelConfig) -> TokenSource:
    if data.source == "file":
        assert data.path is not None
        return TokenFile(data.path, data.dtype, model.seq_len, model.vocab_size, data.seed, data.shuffle)
    return SyntheticTokens(model.vocab_size, model.seq_len, data.seed)


def batch(source: TokenSource, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, each (len(ids), seq_len)."""
    rows = torch.stack([source.sample(i) for i in ids])
    return rows[:, :-1], rows[:, 1:]
