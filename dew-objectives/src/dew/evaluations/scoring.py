"""What dew's shipped tasks share: a mesh to run on, and a compiled log-likelihood scorer.

``loglikelihoods`` scores rows of token ids sharded like training batches:
global batches of a fixed number of rows, each process holding its share
(``share_rows``), put on the mesh with ``shard_batch`` and scored by one
program compiled per model, mesh and shape, whose result every process
receives whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.evaluations.base import share_rows
from dew.nn.moe import MOE_COLLECTION
from dew.training.placement.mesh import BATCH_AXES, build_mesh, data_partition, shard_batch

if TYPE_CHECKING:
    from collections.abc import Hashable

    from flax.linen import Module

    from dew.objectives.base import Variables

__all__ = ["global_rows", "loglikelihoods", "task_mesh"]

_COMPILED: dict[Hashable, Callable] = {}  # (model, mesh) -> the jitted scorer (its compiles keyed by shape)
_KEPT = 8


def task_mesh(mesh: Mesh | None) -> Mesh:
    """The mesh a task runs on: the run's, or every device along the data axis."""
    return build_mesh() if mesh is None else mesh


def global_rows(batch: int, mesh: Mesh) -> int:
    """batch rounded up to a whole number of rows for every data shard of mesh."""
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    return -(-max(batch, 1) // shards) * shards


def _scorer(model: Module, mesh: Mesh) -> Callable:
    """One jitted scorer per model and mesh (equal modules share it, so a rebuilt model recompiles nothing)."""
    try:
        key: Hashable = (hash(model), model, mesh)
    except TypeError:  # a module holding something unhashable: one scorer per object
        key = (id(model), mesh)
    if key not in _COMPILED:
        if len(_COMPILED) >= _KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
        routed = bool(getattr(model, "experts", 0))  # any flax Module: only MoE families route

        def score(variables: Variables, tokens: jax.Array, mask: jax.Array) -> jax.Array:
            params = {k: v for k, v in variables.items() if k not in ("cache", MOE_COLLECTION)}
            if routed:
                logits = model.apply(params, tokens[:, :-1], mutable=[MOE_COLLECTION])[0]
            else:
                logits = model.apply(params, tokens[:, :-1])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
            return jnp.sum(picked * mask[:, 1:], axis=-1)

        replicated = NamedSharding(mesh, PartitionSpec())
        _COMPILED[key] = jax.jit(score, out_shardings=replicated)
    return _COMPILED[key]


def loglikelihoods(model: Module, variables: Variables, rows: Sequence[tuple[Sequence[int], int]],
                   *, batch: int, mesh: Mesh | None = None) -> np.ndarray:
    """The summed log-probability of each row's last ``n`` tokens given the ones before them.

    rows are ``(ids, n)`` pairs, every process holding the same list; the
    result, one float per row, is the same on every process.
    """
    mesh = task_mesh(mesh)
    partition = data_partition(mesh)
    size = global_rows(batch, mesh)
    width = max(len(ids) for ids, _ in rows)
    out = np.zeros(len(rows), np.float64)
    score = _scorer(model, mesh)
    for number, mine in enumerate(share_rows(len(rows), size, partition)):
        tokens = np.zeros((len(mine), width), np.int32)
        mask = np.zeros((len(mine), width), np.float32)
        for i, row in enumerate(mine):
            if row < 0:
                continue
            ids, scored = rows[int(row)]
            tokens[i, : len(ids)] = ids
            mask[i, len(ids) - scored: len(ids)] = 1.0
        placed = shard_batch({"tokens": tokens, "mask": mask}, mesh, partition)
        values = np.asarray(jax.device_get(score(variables, placed["tokens"], placed["mask"])))
        first = number * size
        kept = min(size, len(rows) - first)
        out[first:first + kept] = values[:kept]
    return out
