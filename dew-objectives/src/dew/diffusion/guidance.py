"""Classifier-free guidance: train with the condition sometimes dropped, sample from a mix.

In training, :func:`drop_condition` replaces each example's condition by the
null condition with some probability, so one model learns both the
conditional and the unconditional denoiser. In sampling, :func:`guide`
extrapolates from the unconditional estimate towards the conditional one by
the guidance scale: scale 1 is the conditional model, 0 the unconditional.

>>> import jax.numpy as jnp
>>> cond = lambda x, t: (x + 1.0, x - 1.0)
>>> uncond = lambda x, t: (x, x)
>>> x0, eps = guide(cond, uncond, 3.0)(jnp.asarray(0.0), 0.5)
>>> float(x0), float(eps)
(3.0, -3.0)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dew.diffusion.samplers import Denoiser

__all__ = ["drop_condition", "guide"]


def guide(conditional: Denoiser, unconditional: Denoiser, scale: float | jax.Array) -> Denoiser:
    """A denoiser whose estimates are uncond + scale * (cond - uncond).

    The estimates are affine in the model's output at a fixed x, so mixing
    (x0, eps) is the same as mixing the raw outputs of any target.
    """

    def denoise(x: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        x0_c, eps_c = conditional(x, t)
        x0_u, eps_u = unconditional(x, t)
        return x0_u + scale * (x0_c - x0_u), eps_u + scale * (eps_c - eps_u)

    return denoise


def drop_condition(key: jax.Array, condition: Any, null: Any, probability: float) -> Any:
    """condition (a pytree of [batch, ...] arrays) with each row replaced by null at probability.

    null has the same structure, each leaf broadcastable to one row.

    >>> import jax, jax.numpy as jnp
    >>> labels = jnp.arange(6)
    >>> [int(v) for v in drop_condition(jax.random.key(0), labels, jnp.asarray(10), 1.0)]
    [10, 10, 10, 10, 10, 10]
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"The condition dropout probability must lie in [0, 1], got {probability}.")
    leaves = jax.tree.leaves(condition)
    if not leaves:
        return condition
    rows = leaves[0].shape[0]
    drop = jax.random.bernoulli(key, probability, (rows,))

    def choose(value: jax.Array, empty: jax.Array) -> jax.Array:
        mask = drop.reshape((rows,) + (1,) * (value.ndim - 1))
        return jnp.where(mask, jnp.broadcast_to(jnp.asarray(empty, value.dtype), value.shape), value)

    return jax.tree.map(choose, condition, null)
