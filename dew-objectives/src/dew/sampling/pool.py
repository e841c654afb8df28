"""Where an engine's cache lives: its pools' shapes, their sharding, and the mesh they run on.

The pools' shapes come from tracing the model once with an empty 'cache'
collection (once per model, layout and parameter shapes, not per engine). On a
mesh, each pool's key/value heads are split as the attention's activations are
(``POOL_AXES`` under the rules), so a layer writes its keys where it computed them;
a latent attention's pools have one shared "head" and are kept whole on every device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.paged_attention import POOL_AXES, PagedView
from dew.sampling import programs
from dew.sampling.errors import InvalidVariablesError, NotPagedModelError

if TYPE_CHECKING:
    from collections.abc import Hashable

    from dew.objectives.base import Variables
    from dew.typing import PyTree

__all__ = ["PoolSharding", "empty_cache", "mesh_of", "model_variables"]

PoolSharding = tuple[tuple[int, jax.sharding.NamedSharding], ...]
"""The sharding of a pool, by the pool's rank (4, or 5 for a scanned stack's)."""

_SHAPES: dict[Hashable, PyTree] = {}


def model_variables(params: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """The model's variables without boxes or a stale 'cache' collection."""
    variables = dict(nn.meta.unbox(params))
    if "params" not in variables:
        raise InvalidVariablesError(
            "The engine takes the model's full variables ({'params': ...}, as state.params "
            f"holds them); got a dict with keys {sorted(variables)}.")
    variables.pop("cache", None)
    return variables


def mesh_of(tree: PyTree) -> jax.sharding.Mesh | None:
    """The mesh of the first leaf of tree placed on more than one device, if any."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)  # any leaf: only placed arrays have one
        if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
            return cast(jax.sharding.Mesh, sharding.mesh)  # a placed array's mesh is concrete
    return None


def _shapes(model: nn.Module, variables: Variables, num_blocks: int, block_size: int, width: int) -> PyTree:
    leaves, structure = jax.tree.flatten(variables)
    signature = (model, num_blocks, block_size, width, structure,
                 tuple((x.shape, str(x.dtype)) for x in leaves))
    if signature not in _SHAPES:
        def empty(variables: Variables) -> PyTree:
            view = PagedView(jnp.zeros((1, width), jnp.int32), jnp.zeros((1, 1), bool),
                             num_blocks, block_size)
            zeros = jnp.zeros((1, 1), jnp.int32)
            return programs.apply(model, variables, {}, zeros, zeros, view)[1]

        _SHAPES[signature] = jax.eval_shape(empty, variables)
    return _SHAPES[signature]


def _sharding(shapes: PyTree, mesh: jax.sharding.Mesh | None, rules: Any) -> PoolSharding | None:
    if mesh is None:
        return None
    heads = jax.tree.leaves(shapes)[0].shape[-2]
    with nn.logical_axis_rules(rules):
        split = nn.logical_to_mesh_axes(POOL_AXES)[2]
    names = (split,) if isinstance(split, str) else tuple(split or ())
    ways = math.prod(dict(mesh.shape).get(n, 1) for n in names)
    spec = (None, None, split if ways > 1 and heads % ways == 0 else None, None)
    ranks = sorted({len(s.shape) for s in jax.tree.leaves(shapes)})
    partition = jax.sharding.PartitionSpec
    return tuple((rank, jax.sharding.NamedSharding(mesh, partition(*[None] * (rank - 4), *spec)))
                 for rank in ranks)


def empty_cache(model: nn.Module, variables: Variables, num_blocks: int, block_size: int, width: int,
                mesh: jax.sharding.Mesh | None, rules: Any) -> tuple[PyTree, PoolSharding | None]:
    """Zeroed pools of num_blocks blocks for model, placed on mesh; and their sharding.

    Call under the mesh and rules when there is one (the model's constraints need them).
    """
    shapes = _shapes(model, variables, num_blocks, block_size, width)
    if not jax.tree.leaves(shapes):
        raise NotPagedModelError(
            f"{type(model).__name__} wrote no paged key/value cache when decoding; the engine "
            "needs a causal decoder whose attention layers are dew.nn.layers.CausalSelfAttention "
            "or dew.nn.latent_attention.LatentAttention (such as the causal_transformer model or "
            "any registered family)."
        )
    sharding = _sharding(shapes, mesh, rules)
    by_rank = dict(sharding or ())
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=by_rank.get(len(s.shape))),
                         shapes)
    return cache, sharding
