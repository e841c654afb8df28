"""A linear regressor: the smallest Flax module worth registering."""

from __future__ import annotations

import flax.linen as nn
import jax

__all__ = ["Regressor"]


class Regressor(nn.Module):
    """y = x W + b, starting from zeros so a run's losses do not depend on the key.

    Its parameters name their logical axes (inputs ``embed``, outputs ``mlp``),
    so dew's layout can shard them over a mesh like its own models'.
    """

    features: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        zeros = nn.initializers.zeros
        return nn.Dense(self.features,
                        kernel_init=nn.with_logical_partitioning(zeros, ("embed", "mlp")),
                        bias_init=nn.with_logical_partitioning(zeros, ("mlp",)))(x)
