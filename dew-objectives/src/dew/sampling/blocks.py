"""The host's book of a paged cache's blocks: who holds each one, and which prefixes they keep.

``BlockPool`` counts the references to every block of the device pool (a
sequence's table and a prompt group waiting for its samples each hold one).
A block nobody holds is free. Full blocks whose keys and values a prefill (or a
finished sequence) wrote are also *registered* under the tokens that led to
them: a later sequence whose prompt starts with the same tokens takes them
instead of computing them again. A registered block nobody holds stays
registered (it can still be reused) until the pool needs the room; the least
recently released goes first. Block 0 is never handed out: the tables'
padding points at it.

>>> pool = BlockPool(5, block_size=2)
>>> first = pool.allocate(2)
>>> pool.register([7, 8, 9, 10], first)        # blocks 1, 2 hold tokens [7, 8], [9, 10]
>>> pool.release(first)                         # free, but still registered
>>> pool.lookup([7, 8, 9, 10, 11]) == first     # a longer prompt reuses both
True
>>> pool.free_blocks, pool.references(first[0])
(2, 1)
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from dew.errors import DewError

__all__ = ["BlockPool", "OutOfBlocksError"]


class OutOfBlocksError(DewError, RuntimeError):
    """The pool has fewer available blocks than asked for (the engine pre-empts a sequence then)."""


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a block: a digest of its tokens and of everything before them."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class BlockPool:
    """Reference counts, free list and prefix registry of num_blocks blocks of block_size positions."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._references = np.zeros(num_blocks, np.int32)
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by no one
        self._by_name: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._stale: set[int] = set()  # held across a forget: written with the old model, never registered

    # -- counts ------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks that allocate can hand out now: free ones and registered ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks that some sequence or group holds."""
        return int(np.count_nonzero(self._references))

    def references(self, block: int) -> int:
        return int(self._references[block])

    # -- holding -----------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """count blocks, each held once; free ones first, then the least recently released
        registered ones (which are unregistered). Raises OutOfBlocksError if there are fewer."""
        if count > self.free_blocks:
            raise OutOfBlocksError(f"{count} blocks asked for, {self.free_blocks} available.")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_name[self._name_of.pop(block)]
            self._references[block] = 1
            self._stale.discard(block)  # handed out again: whatever is written next is the new model's
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Hold blocks once more (another sequence's table points at them)."""
        for block in blocks:
            if self._references[block] == 0:
                self._cached.pop(block, None)
            self._references[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each of blocks; a block nobody holds becomes available."""
        for block in blocks:
            if self._references[block] <= 0:
                raise RuntimeError(f"Block {block} released more often than it was held.")
            self._references[block] -= 1
            if self._references[block] == 0:
                if block in self._name_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # -- the prefix registry ---------------------------------------------------------
    def register(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Name the full blocks of a table whose keys and values are written for tokens.

        blocks[j] holds positions ``j*block_size ... (j+1)*block_size - 1``; only blocks
        that tokens fill are registered, and a name already taken keeps its block.
        """
        name = b""
        for j in range(min(len(tokens) // self.block_size, len(blocks))):
            name = _chain(name, tokens[j * self.block_size:(j + 1) * self.block_size])
            block = blocks[j]
            if block in self._stale:  # a sequence still in flight across new weights: not reusable
                break
            if name in self._by_name or block in self._name_of:
                continue
            self._by_name[name] = block
            self._name_of[block] = name

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The registered blocks that hold the longest run of tokens' full blocks, held once more."""
        found, name = [], b""
        for j in range(len(tokens) // self.block_size):
            name = _chain(name, tokens[j * self.block_size:(j + 1) * self.block_size])
            block = self._by_name.get(name)
            if block is None:
                break
            found.append(block)
        self.share(found)
        return found

    def forget(self) -> None:
        """Unregister every block (the model changed: what they hold is stale). The blocks still
        held (sequences and groups in flight keep what they wrote) are never registered later."""
        for block in list(self._cached):
            self._free.append(block)
        self._cached.clear()
        self._by_name.clear()
        self._name_of.clear()
        self._stale = {int(block) for block in np.flatnonzero(self._references)}
