"""Grouped matmuls: rows sorted by group, each group multiplied by its own weight matrix.

A dropless mixture of experts sorts its token-expert assignments by expert
and multiplies each expert's run of rows by that expert's weights. Two ways
compute it, with the same result:

- ``"ragged_dot"``: ``jax.lax.ragged_dot``, a grouped matmul that GPUs and
  TPUs run natively, with the work of the rows alone. XLA:CPU has no ragged
  dot, and JAX lowers it there to a dense product masked per group: every
  row times every group's weights, groups times the work.
- ``"tiles"``: each group's rows padded to whole tiles of ``tile`` rows,
  and every tile multiplied by its group's weights (one batched einsum over
  the tiles, the weights gathered per tile). The work is the rows' plus at
  most ``tile - 1`` padding rows per group, which is what the compiled
  program counts, and all of it is plain gathers and einsums that any
  backend and the SPMD partitioner handle.

``"auto"`` takes ragged_dot on GPUs and TPUs and tiles on the CPU.

>>> import jax.numpy as jnp
>>> x = jnp.arange(6.0).reshape(3, 2)  # rows 0-1 in group 0, row 2 in group 1
>>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
>>> groups = SortedGroups.of(jnp.asarray([2, 1]), rows=3, kind="tiles", tile=2)
>>> groups.unpack(groups.matmul(groups.pack(x), w)).tolist()
[[0.0, 1.0], [2.0, 3.0], [8.0, 10.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from dew.errors import DewError

__all__ = ["GROUPED_MATMULS", "GroupedMatmulError", "SortedGroups", "default_tile"]

GROUPED_MATMULS = ("auto", "ragged_dot", "tiles")
"""The ways SortedGroups multiplies: see the module's docstring."""

GroupedMatmul = Literal["auto", "ragged_dot", "tiles"]


class GroupedMatmulError(DewError, ValueError):
    """A grouped matmul was asked for with a kind or tile that does not exist."""


def default_tile(rows: int, groups: int) -> int:
    """The tile for rows over groups: padding (at most groups * (tile - 1) rows) stays
    within an eighth of the rows, and a tile holds at most 128 rows.

    >>> default_tile(8192, 8), default_tile(32, 4)
    (128, 1)
    """
    tile = 1
    while tile * 2 <= min(128, rows // (8 * groups)):
        tile *= 2
    return tile


@dataclass(frozen=True)
class SortedGroups:
    """rows rows sorted by group, sizes[g] of them in group g, and how matmuls run over them.

    ``pack`` lays the rows [rows, D] out for ``matmul`` (which multiplies each
    group by its weights [G, D, M]) and ``unpack`` reads the rows back; pack
    once, run a whole feed-forward block packed (zero padding rows stay zero
    through it), unpack once. Build with :meth:`of`.
    """

    sizes: jax.Array
    rows: int
    kind: Literal["ragged_dot", "tiles"]
    tile: int = 1
    source: jax.Array | None = None  # tiles: each padded slot's row, ``rows`` where it pads
    destination: jax.Array | None = None  # tiles: each row's padded slot
    tile_groups: jax.Array | None = None  # tiles: each tile's group

    @classmethod
    def of(cls, sizes: jax.Array, rows: int, kind: GroupedMatmul = "auto",
           tile: int | None = None) -> SortedGroups:
        """The groups of sizes (int [G], summing to rows) under kind ("auto": by backend)."""
        if kind not in GROUPED_MATMULS:
            raise GroupedMatmulError(f"Unknown grouped matmul {kind!r}; use one of "
                                     f"{', '.join(map(repr, GROUPED_MATMULS))}.")
        if kind == "auto":
            kind = "tiles" if jax.default_backend() == "cpu" else "ragged_dot"
        sizes = jnp.asarray(sizes, jnp.int32)
        if kind == "ragged_dot":
            return cls(sizes, rows, "ragged_dot")
        count = int(sizes.shape[0])
        tile = default_tile(rows, count) if tile is None else tile
        if tile < 1:
            raise GroupedMatmulError(f"A grouped matmul's tile must hold at least one row, got {tile}.")
        tiles = (rows + count * (tile - 1)) // tile  # the most whole tiles the groups can need
        ends = jnp.cumsum(sizes)
        starts = ends - sizes
        padded = (sizes + tile - 1) // tile * tile
        padded_ends = jnp.cumsum(padded)
        padded_starts = padded_ends - padded

        row = jnp.arange(rows, dtype=jnp.int32)
        group_of_row = jnp.searchsorted(ends, row, side="right")
        destination = padded_starts[group_of_row] + row - starts[group_of_row]

        slot = jnp.arange(tiles * tile, dtype=jnp.int32)
        group_of_slot = jnp.minimum(jnp.searchsorted(padded_ends, slot, side="right"), count - 1)
        offset = slot - padded_starts[group_of_slot]
        used = (slot < padded_ends[-1]) & (offset < sizes[group_of_slot])
        source = jnp.where(used, starts[group_of_slot] + offset, rows)
        return cls(sizes, rows, "tiles", tile, source, destination, group_of_slot[::tile])

    def pack(self, x_rd: jax.Array) -> jax.Array:
        """x_rd [rows, D] as matmul reads it: itself (ragged_dot), or tiles [P, tile, D]."""
        if self.kind == "ragged_dot":
            return x_rd
        assert self.source is not None
        padded = jnp.take(x_rd, self.source, axis=0, mode="fill", fill_value=0)
        return padded.reshape(-1, self.tile, x_rd.shape[-1])

    def matmul(self, packed: jax.Array, weights_gdm: jax.Array) -> jax.Array:
        """Each group's packed rows times that group's weights [G, D, M]."""
        if self.kind == "ragged_dot":
            return jax.lax.ragged_dot(packed, weights_gdm, self.sizes)
        assert self.tile_groups is not None
        per_tile_pdm = jnp.take(weights_gdm, self.tile_groups, axis=0)
        return jnp.einsum("ptd,pdm->ptm", packed, per_tile_pdm)

    def unpack(self, packed: jax.Array) -> jax.Array:
        """The rows [rows, M] of packed matmul outputs, in the sorted order pack read them."""
        if self.kind == "ragged_dot":
            return packed
        assert self.destination is not None
        return jnp.take(packed.reshape(-1, packed.shape[-1]), self.destination, axis=0)
