"""Every parameter of every family names its logical axes (issue 26, item 1), so Layout shards it
by the declared rules rather than by the undeclared-leaf heuristic: biases, q/k and sandwich norms,
fused projections, routers and expert stacks, the latent attention's projections and norms."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from dew.families import FAMILIES, family
from dew.nn import sharding

# The options no tiny preset turns on, on top of the presets (which hold the others).
OPTIONS = {"llama": {"qkv_bias": True, "out_bias": True, "mlp_bias": True}, "deepseek_v3": {"qkv_bias": True}}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_parameter_of_a_family_names_its_logical_axes(name):
    model = family(name).build("tiny", **OPTIONS.get(name, {}))
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    leaves = jax.tree_util.tree_flatten_with_path(
        abstract["params"], is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))[0]
    allowed = set(sharding.PARAMETER_AXES) | {None}
    assert leaves
    for path, leaf in leaves:
        where = jax.tree_util.keystr(path)
        assert isinstance(leaf, nn.LogicallyPartitioned), f"{name}: {where} declares no axes"
        assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= allowed, (where, leaf.names)
    if model.mlp_block == "routed":  # each expert stack is split over the expert axis
        stacks = [leaf for path, leaf in leaves if "moe" in jax.tree_util.keystr(path) and leaf.value.ndim == 3]
        assert stacks and all(leaf.names[0] == sharding.EXPERT for leaf in stacks), [leaf.names for leaf in stacks]
