"""A submodule's output beside a model's own: the hidden state a head reads (a reward model's score,
PPO's value head, and an export's check of the score)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

__all__ = ["with_features"]


def with_features(model: nn.Module, variables: Any, tokens: jax.Array, module: str, *,
                  head: str, field: str) -> tuple[Any, jax.Array]:
    """model's output on tokens, and the output of its submodule called module (its ``__call__``).

    A model with no such submodule is refused as a ValueError naming head (what reads it, "the
    value head") and field (where it is set, "PPOObjective(features_module=...)").
    """
    out, captured = model.apply(
        variables, tokens, mutable=["intermediates"],
        capture_intermediates=lambda submodule, method: submodule.name == module and method == "__call__")
    found = captured["intermediates"].get(module)
    if found is None:
        raise ValueError(f"The model has no submodule named {module!r} to read hidden states from for {head}; "
                         f"set {field} to the module whose output is the last hidden state.")
    return out, found["__call__"][0]
