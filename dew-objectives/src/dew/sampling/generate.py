"""Autoregressive generation with a key/value cache.

The prompts are right-padded into one batch and run through the model once
(the prefill), which fills every layer's cache. Then one token per row is
decoded at a time inside a ``lax.fori_loop``: each step feeds the last
token at its row's own position, so prompts of different lengths generate
exactly what they would alone, and each step costs the same however long the
prompts were. Given an end-of-document id, a row stops at it (the id ends its
new tokens) and the loop ends early once every row has stopped. The whole
loop is compiled once per (batch, padded length, max_new_tokens, sampling,
end-of-document id, model).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.errors import DewError
from dew.sampling.options import Sampling, choose

__all__ = ["Generation", "InvalidPromptError", "PromptTooLongError", "generate", "sample_on_device"]


class InvalidPromptError(DewError, ValueError):
    """The prompts are not a batch of non-empty token-id sequences."""


class PromptTooLongError(DewError, ValueError):
    """A prompt plus the tokens to generate would not fit in the model's max_seq_len."""


@dataclass(frozen=True)
class Generation:
    """What generate returns.

    tokens holds, per row, the prompt followed by the new tokens (plain
    ints); prompt_lengths says where each prompt ends; stopped says which
    rows ended at the end-of-document id (which is then their last token).
    """

    tokens: list[list[int]]
    prompt_lengths: tuple[int, ...]
    stopped: tuple[bool, ...] = ()

    @property
    def new_tokens(self) -> list[list[int]]:
        """Only the generated tokens of each row."""
        return [row[n:] for row, n in zip(self.tokens, self.prompt_lengths, strict=True)]


def _rows(prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array) -> list[list[int]]:
    if isinstance(prompts, np.ndarray | jax.Array):
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise InvalidPromptError(
                f"An array of prompts must be 2-D [batch, length], got shape {array.shape}; "
                "wrap a single prompt as [prompt]."
            )
        rows = [list(map(int, row)) for row in array]
    else:
        rows = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, int | np.integer):
                raise InvalidPromptError(
                    "prompts is a batch: a list of token-id lists. Got a flat list of ints; "
                    "wrap a single prompt as [prompt]."
                )
            row = np.asarray(prompt).reshape(-1)
            if row.size and not np.issubdtype(row.dtype, np.integer):
                raise InvalidPromptError(f"Prompt {i} holds {row.dtype} values, not token ids.")
            rows.append([int(t) for t in row])
    if not rows:
        raise InvalidPromptError("generate needs at least one prompt.")
    empty = [i for i, row in enumerate(rows) if not row]
    if empty:
        raise InvalidPromptError(
            f"Prompts {empty} are empty; every prompt needs at least one token "
            "(for example a beginning-of-text id)."
        )
    return rows


def _variables(params: Mapping[str, Any]) -> dict[str, Any]:
    variables = dict(nn.meta.unbox(params))
    if "params" not in variables:
        raise InvalidPromptError(
            "generate takes the model's full variables ({'params': ...}, as state.params "
            f"holds them); got a dict with keys {sorted(variables)}."
        )
    variables.pop("cache", None)
    return variables


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "eos_id"))
def _generate(model: nn.Module, variables: dict[str, Any], padded: jax.Array,
              lengths: jax.Array, key: jax.Array, *, max_new_tokens: int,
              sampling: Sampling, eos_id: int | None) -> jax.Array:
    batch, width = padded.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, mutated = model.apply(variables, padded, positions, decode=True, mutable=["cache"])
    last = logits[jnp.arange(batch), lengths - 1]
    first = choose(last, jax.random.fold_in(key, 0), sampling)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    done = first == eos_id if eos_id is not None else jnp.zeros((batch,), bool)

    def running(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(carry):
        i, cache, token, out, done = carry
        logits, mutated = model.apply(
            {**variables, "cache": cache}, token[:, None], (lengths + i - 1)[:, None],
            decode=True, mutable=["cache"],
        )
        token = choose(logits[:, 0], jax.random.fold_in(key, i), sampling)
        out = out.at[:, i].set(jnp.where(done, -1, token))
        if eos_id is not None:
            done = done | (token == eos_id)
        return i + 1, mutated["cache"], token, out, done

    carry = (jnp.asarray(1, jnp.int32), mutated["cache"], first, out, done)
    return jax.lax.while_loop(running, step, carry)[3]


def generate(
    model: nn.Module,
    params: Mapping[str, Any],
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    max_new_tokens: int,
    key: jax.Array,
    sampling: Sampling = Sampling(),
    *,
    eos_id: int | None = None,
) -> Generation:
    """Continue each prompt by max_new_tokens tokens.

    model is a module with a cached decode path (``CausalTransformer``),
    params its full variables (``state.params``; partitioned boxes are
    accepted), prompts a list of token-id sequences, possibly of different
    lengths, or a 2-D array. key drives the random draws (unused when
    sampling is greedy). With eos_id, a row stops after producing it, so it
    may hold fewer than max_new_tokens new tokens.
    """
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
            or max_new_tokens < 0:
        raise InvalidPromptError(f"max_new_tokens must be a non-negative integer, got "
                                 f"{max_new_tokens!r}.")
    max_new_tokens = int(max_new_tokens)
    rows = _rows(prompts)
    lengths = [len(row) for row in rows]
    limit = getattr(model, "max_seq_len", None)  # any flax Module: unbounded if it does not say
    if limit is not None and max(lengths) + max_new_tokens > limit:
        longest = max(lengths)
        raise PromptTooLongError(
            f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is "
            f"{longest + max_new_tokens} tokens, more than the model's max_seq_len={limit}. "
            f"Ask for at most {max(limit - longest, 0)} new tokens or shorten the prompt."
        )
    if max_new_tokens == 0:
        return Generation([list(row) for row in rows], tuple(lengths), (False,) * len(rows))
    padded = np.zeros((len(rows), max(lengths)), np.int32)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    new = _generate(model, _variables(params), jnp.asarray(padded),
                    jnp.asarray(lengths, jnp.int32), key,
                    max_new_tokens=max_new_tokens, sampling=sampling,
                    eos_id=None if eos_id is None else int(eos_id))
    tokens, stopped = [], []
    for row, produced in zip(rows, np.asarray(new).tolist(), strict=True):
        produced = [t for t in produced if t >= 0]
        tokens.append(row + produced)
        stopped.append(eos_id is not None and bool(produced) and produced[-1] == eos_id)
    return Generation(tokens, tuple(lengths), tuple(stopped))


def sample_on_device(model: nn.Module, params: Mapping[str, Any], padded: jax.Array, lengths: jax.Array,
                     key: jax.Array, max_new_tokens: int, sampling: Sampling = Sampling()) -> jax.Array:
    """New tokens [B, max_new_tokens] for right-padded prompts, left on the devices.

    The sampler generate uses, without its host-side checks and copies: the
    parameters are an argument of the compiled loop (read where they live,
    as a trainer's state holds them), and one compile serves every call with
    the same shapes. A rollout calls this at each step with the live policy.
    """
    return _generate(model, _variables(params), padded, lengths, key,
                     max_new_tokens=int(max_new_tokens), sampling=sampling, eos_id=None)
