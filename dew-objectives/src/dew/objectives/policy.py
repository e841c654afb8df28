"""What the preference and RL objectives share: a policy beside its frozen reference.

The variables of such an objective are the policy's own Flax variables
(``{"params": ...}``, exactly what a language-model run trains and saves)
plus a ``reference`` collection holding a copy of the policy's starting
parameters. The collection is declared frozen, so the trainer keeps one copy
of it, never differentiates it and gives it no optimizer state or EMA.
Because the policy sits where a language model's parameters sit, a run can
start from a language-model run's checkpoint (a recipe's ``init`` section,
narrowed to the policy by ``PolicyFrom``), and the reference becomes a copy
of those trained weights.

``token_logprobs`` scores tokens under a model: the log-probability of every
token given the ones before it. ``policy_pipeline`` is what every objective
that trains a causal language model serves once trained: text generation
from the policy alone (its EMA copy when kept), without the reference, a
value head or a teacher, with the run's tokenizer and stop token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.objectives.base import Variables
from dew.objectives.inference import variables_of
from dew.sampling import Sampling, TextGeneration
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.data.base import Tokenizer
    from dew.training.state import TrainState

__all__ = ["REFERENCE", "PolicyFrom", "check_model_reach", "chosen_logprobs", "policy_pipeline", "policy_variables",
           "reference_variables", "token_logprobs", "with_reference"]

REFERENCE = "reference"


def check_model_reach(name: str, model: object, *, seq_len: int | None = None,
                      stop_token: int | None = None, max_new_tokens: int | None = None) -> None:
    """Refuse, as an objective is built, sequences longer than its model reads (max_seq_len), completions
    of no token or of as many as leave no room for a prompt, and a stop token outside its vocabulary:
    each fails once the run has started, or never stops a completion."""
    limit = getattr(model, "max_seq_len", None)  # any flax Module: one that says it bounds the length
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"{name}.seq_len must be at least 1 (the tokens of a row), got {seq_len}.")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"{name}.max_new_tokens must be at least 1 (the completion a reward scores), "
                         f"got {max_new_tokens}.")
    if max_new_tokens is not None and isinstance(limit, int) and max_new_tokens >= limit:
        raise ValueError(f"{name}.max_new_tokens={max_new_tokens} leaves no position for a prompt in the "
                         f"model's max_seq_len={limit}: a prompt and its completion share the model's length. "
                         "Lower max_new_tokens, or build a model with a longer max_seq_len.")
    if seq_len is not None and isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"{name}.seq_len={seq_len} exceeds the model's max_seq_len={limit}; shorten the "
                         "sequences or build a model with a longer max_seq_len.")
    vocab = getattr(model, "vocab_size", None)  # any flax Module: one that says its vocabulary
    if stop_token is not None and isinstance(vocab, int) and not 0 <= stop_token < vocab:
        raise ValueError(f"{name}.stop_token={stop_token} is outside the model's vocabulary [0, {vocab}): no "
                         "completion could stop on it.")


def token_logprobs(model: nn.Module, variables: Variables, tokens: jax.Array,
                   temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1, as [B, T-1], and the entropy of each prediction.

    temperature divides the logits first: the distribution a rollout sampled from at that
    temperature, so a ratio to the sampling policy is taken against what really sampled (TRL's
    convention); 1 is the model's own.

    >>> import jax.numpy as jnp, flax.linen as nn
    >>> class Uniform(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return jnp.zeros(x.shape + (4,))
    >>> logp, entropy = token_logprobs(Uniform(), {}, jnp.zeros((1, 3), jnp.int32))
    >>> [round(float(v), 4) for v in logp[0]], round(float(entropy[0, 0]), 4)
    ([-1.3863, -1.3863], 1.3863)
    """
    logits = model.apply(variables, tokens[:, :-1])
    return chosen_logprobs(logits, tokens, temperature)


def chosen_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """From the logits of tokens[:, :-1], each next token's log-probability at temperature, and
    each prediction's entropy at that temperature ([B, T-1] both)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return chosen, entropy


def policy_variables(variables: Variables) -> dict[str, PyTree]:
    """The policy's own variables: everything but the reference collection (and a decode cache)."""
    return {k: v for k, v in variables.items() if k not in (REFERENCE, "cache")}


def policy_pipeline(model: nn.Module, state: TrainState | Variables, tokenizer: Tokenizer | None, *,
                    sampling: Sampling | Mapping[str, Any] | None = None,
                    stop_token: int | None = None,
                    leave_out: tuple[str, ...] = ()) -> TextGeneration:
    """Text generation from the policy in state: a TrainState (its EMA copy when kept) or variables.

    The pipeline holds the policy's own variables: the frozen reference, a
    decode cache and the top-level parameters named in leave_out (a value
    head) stay behind. It samples greedily unless sampling (a Sampling or
    its fields) says otherwise, and a continuation ends at stop_token
    (default: the tokenizer's end-of-document id).
    """
    if isinstance(sampling, Mapping):  # a recipe's or a caller's {temperature: ..., top_k: ...}
        sampling = Sampling(**sampling)
    variables = policy_variables(variables_of(state))
    if leave_out:
        variables["params"] = {k: v for k, v in variables["params"].items() if k not in leave_out}
    return TextGeneration(model, variables, tokenizer, sampling or Sampling(temperature=0.0),
                          stop_token=stop_token)


def reference_variables(variables: Variables) -> dict[str, PyTree]:
    """The frozen reference as variables the model applies ({"params": ...})."""
    if REFERENCE not in variables:
        raise KeyError(
            f"The variables hold no {REFERENCE!r} collection (they hold {sorted(variables)}); the "
            "objective was built without a frozen reference."
        )
    return {"params": jax.lax.stop_gradient(variables[REFERENCE])}


def with_reference(policy: Variables) -> dict[str, PyTree]:
    """The policy's variables plus a reference collection copying its parameters.

    Starting weights that already hold a reference pass through unchanged.
    """
    policy = dict(policy)
    if REFERENCE in policy:
        return policy
    return {**policy, REFERENCE: jax.tree.map(jnp.copy, policy["params"])}


@dataclass(frozen=True)
class PolicyFrom:
    """The policy's parameters read by another weight source, for an objective holding a reference.

    source is what a recipe's ``init`` section reads (another run's
    checkpoint through ``dew.training.ParamsFrom``, say). It is asked for
    the ``params`` collection alone (a language-model run's weights), less
    the top-level parameters named in ``exclude`` (a value head the other
    run did not have); the objective's ``init`` then copies them into the
    reference and adds what was left out. The objectives build it in
    ``starting_weights``, which the recipe runner applies to ``init``.
    """

    source: Callable[[Variables], Variables]
    exclude: tuple[str, ...] = ()

    def __call__(self, abstract: Variables) -> Variables:
        params = {k: v for k, v in abstract["params"].items() if k not in self.exclude}
        return self.source({"params": params})


def unboxed(variables: Variables) -> dict[str, PyTree]:
    return dict(nn.meta.unbox(variables))
