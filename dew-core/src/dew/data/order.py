"""The global record order: seeded epoch permutations laid end to end.

Epoch ``e`` of ``n`` records is ``permute(range(n), n, seed, e)``: a 4-round
Feistel network (splitmix64 as the round function) over the smallest
even-bit domain that holds ``n``, with cycle-walking back into range. Like
Grain's index shuffle it maps each index on its own, so any slice of any
epoch costs the same; unlike it, it runs vectorised in numpy, and the order
is fixed by this code rather than by a library version.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["RecordOrder", "epoch_order", "permute"]

_MASK = (1 << 64) - 1


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on a uint64 array (wrapping arithmetic)."""
    z = values + _GOLDEN
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


@functools.lru_cache(maxsize=64)
def _round_keys(seed: int, epoch: int, rounds: int = 4) -> tuple[np.uint64, ...]:
    base = _splitmix64(np.asarray([seed & _MASK], np.uint64))
    mixed = _splitmix64(base ^ np.asarray([epoch & _MASK], np.uint64))
    return tuple(_splitmix64(mixed + np.arange(1, rounds + 1, dtype=np.uint64)))


def permute(indices: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where each index of one epoch goes: a seeded bijection of range(n), computed per index.

    A 4-round Feistel network over the smallest even-bit domain that holds n
    (splitmix64 as the round function), cycle-walking values that land past
    n back into range. It needs no table, so any slice of any epoch costs
    the same, whatever n is.
    """
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _round_keys(seed, epoch)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_splitmix64(right ^ key) & mask)
        return (left << shift) | right

    out = feistel(np.asarray(indices, dtype=np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = feistel(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The records of one epoch in stream order (a permutation of range(n))."""
    return permute(np.arange(n, dtype=np.uint64), n, seed, epoch)


_TABLE_LIMIT = 1 << 22  # up to this many records, an epoch's order is computed whole and kept


class RecordOrder:
    """The record index at each position of the endless order (epochs laid end to end).

    Small datasets keep the last two epochs' orders as tables (one fancy index per
    chunk); larger ones compute each chunk's indices with permute. Both agree.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._tables: dict[int, np.ndarray] = {}

    def __getstate__(self) -> tuple[int, int]:
        return self.n, self.seed

    def __setstate__(self, state: tuple[int, int]) -> None:
        RecordOrder.__init__(self, *state)

    def _epoch(self, epoch: int, within: np.ndarray) -> np.ndarray:
        if self.n > _TABLE_LIMIT:
            return permute(within, self.n, self.seed, epoch)
        if epoch not in self._tables:
            if len(self._tables) >= 2:
                self._tables.pop(min(self._tables))
            self._tables[epoch] = epoch_order(self.n, self.seed, epoch)
        return self._tables[epoch][within]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(positions, self.n)
        if epochs[0] == epochs[-1]:
            return self._epoch(int(epochs[0]), within)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self._epoch(int(epoch), within[here])
        return out
