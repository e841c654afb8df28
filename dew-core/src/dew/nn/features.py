"""A submodule's output beside a model's own: the hidden state a head reads (a reward model's score,
PPO's value head, and an export's check of the score)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["check_features_module", "submodule_names", "with_features"]


def with_features(model: nn.Module, variables: Any, tokens: jax.Array, module: str, *,
                  head: str, field: str) -> tuple[Any, jax.Array]:
    """model's output on tokens, and the output of its submodule called module (its ``__call__``).

    A model with no such submodule is refused as a ValueError naming head (what reads it, "the
    value head") and field (where it is set, "PPOObjective(features_module=...)").
    """
    out, captured = model.apply(
        variables, tokens, mutable=["intermediates"],
        capture_intermediates=lambda submodule, method: submodule.name == module and method == "__call__")
    found = captured.get("intermediates", {}).get(module)  # nothing captured: no collection at all
    if found is None:
        raise ValueError(f"The model has no submodule named {module!r} to read hidden states from for {head}; "
                         f"set {field} to the module whose output is the last hidden state.")
    return out, found["__call__"][0]


def submodule_names(model: nn.Module, length: int = 1, *, top: bool = False) -> set[str]:
    """The names of model's submodules that run in a call on length tokens (top: those directly
    under the model; else at any depth), traced abstractly: no weight is made."""
    tokens = jnp.zeros((1, length), jnp.int32)
    _, variables = jax.eval_shape(
        lambda: model.init_with_output(jax.random.key(0), tokens, capture_intermediates=True))

    def names(tree: Any) -> set[str]:
        found = set(tree) - {"__call__"}
        return found if top else found.union(*(names(tree[name]) for name in found))

    return names(variables.get("intermediates", {}))


def check_features_module(model: nn.Module, module: str, *, field: str) -> None:
    """Refuse, as an objective is built, a features module its model does not have (field is where
    it is set, "PPOObjective.features_module"), naming the model's top-level ones."""
    if module not in submodule_names(model):
        raise ValueError(f"{field}={module!r} names no submodule of the model, so no head can read its hidden "
                         f"states; its top-level submodules are {', '.join(sorted(submodule_names(model, top=True)))} "
                         "(the last hidden state is the final norm's output: final_norm in dew's decoders).")
