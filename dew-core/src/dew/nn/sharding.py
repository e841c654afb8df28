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
...         return constrain(x * w[None, :], (BATCH, ACTIVATION_EMBED))
>>> variables = Scale().init(jax.random.key(0), jnp.ones((2, 3)))
>>> nn.get_partition_spec(variables)["params"]["scale"]
P('embed',)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

from dew.errors import DewError

__all__ = [
    "ACTIVATION_AXES",
    "ACTIVATION_EMBED",
    "ACTIVATION_EXPERT",
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
    "SequenceSplitError",
    "constrain",
    "param",
    "partitioned",
    "split_over",
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
ACTIVATION_EXPERT = "activation_expert"
"""The expert dimension of the tokens an MoE layer dispatched to its experts."""

ACTIVATION_AXES: tuple[str, ...] = (
    BATCH,
    ACTIVATION_LENGTH,
    ACTIVATION_EMBED,
    ACTIVATION_HEADS,
    ACTIVATION_MLP,
    ACTIVATION_VOCAB,
    ACTIVATION_EXPERT,
)

Initializer = Callable[..., jax.Array]


class SequenceSplitError(DewError, ValueError):
    """An activation's positions do not divide over the mesh axes its length is split on."""


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
    _check_length(x, axes)
    return nn.with_logical_constraint(x, axes)


def split_over(logical: str) -> tuple[tuple[str, ...], int]:
    """The mesh axes a logical axis maps to under the current mesh and axis rules that split it (more
    than one device each), and how many devices they make together; ``((), 1)`` outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    mapped = nn.logical_to_mesh_axes((logical,))[0]
    named = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
    sizes = dict(mesh.shape)
    names = tuple(name for name in named if sizes.get(name, 1) > 1)
    ways = 1
    for name in names:
        ways *= sizes[name]
    return names, ways


def _check_length(x: jax.Array, axes: tuple[str | None, ...]) -> None:
    """Refuse positions the sequence split cannot divide evenly, naming both numbers.

    The compiler would pad an uneven split silently; a sequence length the
    'sequence' axis does not divide is almost always a configuration mistake,
    and the message is clearer here than a shape error deep in the step.
    """
    if ACTIVATION_LENGTH not in axes:
        return
    names, ways = split_over(ACTIVATION_LENGTH)
    length = x.shape[axes.index(ACTIVATION_LENGTH)]
    if ways > 1 and length % ways:
        raise SequenceSplitError(
            f"A sequence of {length} positions cannot be split evenly over the mesh axes "
            f"{names} ({ways} devices); use a sequence length that is a multiple of {ways}, "
            f"or set MeshSpec.sequence to a divisor of {length}."
        )
