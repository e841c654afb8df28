"""Logical axis names: how dew's modules say what each array dimension means.

A module never names a device or a mesh axis. It tags each parameter
dimension with a logical name (``"embed"``, ``"heads"``, ...) and each
activation it wants placed with an activation name (``"batch"``,
``"activation_length"``, ...). The trainer's ``Layout`` maps these names onto
the mesh with a table of rules, so the same model code runs on one device or
on many.

Parameters are created through :func:`param` (or any initializer wrapped by
:func:`partitioned`), which stores them as ``flax.linen.LogicallyPartitioned``
boxes. ``flax.linen.get_partition_spec`` reads the names back from an
abstract init, and ``flax.linen.meta.unbox`` strips the boxes.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> class Scale(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         w = param(self, "scale", nn.initializers.ones, (x.shape[-1],), (EMBED,))
...         return constrain(x * w, (BATCH, ACTIVATION_EMBED))
>>> variables = Scale().init(jax.random.key(0), jnp.ones((2, 3)))
>>> nn.get_partition_spec(variables)["params"]["scale"]
P('embed',)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

__all__ = [
    "ACTIVATION_AXES",
    "ACTIVATION_EMBED",
    "ACTIVATION_HEADS",
    "ACTIVATION_LENGTH",
    "ACTIVATION_MLP",
    "ACTIVATION_VOCAB",
    "BATCH",
    "EMBED",
    "EXPERT",
    "HEADS",
    "KV",
    "LAYERS",
    "MLP",
    "PARAMETER_AXES",
    "VOCAB",
    "AxisNames",
    "constrain",
    "param",
    "partitioned",
]

AxisNames = Sequence[str | None]

# -- parameter axes ------------------------------------------------------------
VOCAB = "vocab"
"""Rows of an embedding table and columns of the output head: one per token id."""
EMBED = "embed"
"""The model (residual stream) width."""
MLP = "mlp"
"""The hidden width of a feed-forward block."""
HEADS = "heads"
"""Attention heads."""
KV = "kv"
"""The width of one attention head (queries, keys and values alike)."""
EXPERT = "expert"
"""Experts of a mixture-of-experts layer."""
LAYERS = "layers"
"""The leading dimension of a stacked (scanned) layer's parameters."""

PARAMETER_AXES: tuple[str, ...] = (VOCAB, EMBED, MLP, HEADS, KV, EXPERT, LAYERS)

# -- activation axes -------------------------------------------------------------
BATCH = "batch"
"""Rows of a batch (examples)."""
ACTIVATION_LENGTH = "activation_length"
"""Positions along the sequence."""
ACTIVATION_EMBED = "activation_embed"
"""The residual-stream width of an activation."""
ACTIVATION_HEADS = "activation_heads"
"""Attention heads of an activation."""
ACTIVATION_MLP = "activation_mlp"
"""The hidden width inside a feed-forward block."""
ACTIVATION_VOCAB = "activation_vocab"
"""The vocabulary dimension of logits."""

ACTIVATION_AXES: tuple[str, ...] = (
    BATCH,
    ACTIVATION_LENGTH,
    ACTIVATION_EMBED,
    ACTIVATION_HEADS,
    ACTIVATION_MLP,
    ACTIVATION_VOCAB,
)

Initializer = Callable[..., jax.Array]


def partitioned(init: Initializer, axes: AxisNames) -> Initializer:
    """Wrap an initializer so the array it makes carries logical axis names."""
    return nn.with_logical_partitioning(init, tuple(axes))


def param(
    module: nn.Module,
    name: str,
    init: Initializer,
    shape: Sequence[int],
    axes: AxisNames,
    dtype: Any = None,
) -> jax.Array:
    """Declare a parameter of module whose dimensions carry the logical names axes.

    Returns the unboxed array, as ``Module.param`` does. A mismatch between
    the number of dimensions and of names is refused here, where it is made,
    rather than later when the trainer builds shardings.
    """
    shape = tuple(int(s) for s in shape)
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(
            f"Parameter {name!r} of {type(module).__name__} has shape {shape} but "
            f"{len(axes)} axis names {axes}; give one logical name (or None) per dimension."
        )
    if dtype is None:
        return module.param(name, partitioned(init, axes), shape)
    return module.param(name, partitioned(init, axes), shape, dtype)


def constrain(x: jax.Array, axes: AxisNames) -> jax.Array:
    """Ask the compiler to place activation x by its logical axis names.

    Outside a mesh with rules in context this returns x unchanged, so models
    run the same on one device.
    """
    axes = tuple(axes)
    if len(axes) != x.ndim:
        raise ValueError(
            f"constrain got {len(axes)} axis names {axes} for an array of shape "
            f"{tuple(x.shape)}; give one logical name (or None) per dimension."
        )
    return nn.with_logical_constraint(x, axes)
