"""generate: continue a batch of prompts, through the generation engine.

A thin call into ``dew.sampling.Engine``: every prompt is one request, its
samples drawn with ``fold_in(key, row)``; the engine writes the prompts into a
paged cache, decodes the rows together, and a row that ends (at the
end-of-document id or a stop string) frees its place at once. The engine's
programs are compiled once per (model, configuration, batch size rounded up to
a power of two), so calls with new prompts, keys or parameters reuse them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from dew.sampling.engine import Engine
from dew.sampling.errors import InvalidPromptError, PromptTooLongError
from dew.sampling.options import Sampling
from dew.sampling.requests import EngineConfig, Request

__all__ = ["Generation", "InvalidPromptError", "PromptTooLongError", "default_config", "generate"]


@dataclass(frozen=True)
class Generation:
    """What generate returns.

    tokens holds, per row, the prompt followed by the new tokens (plain
    ints); prompt_lengths says where each prompt ends; stopped says which
    rows ended at the end-of-document id (which is then their last token) or
    at a stop string; logprobs holds the model's log-probability of each new
    token.
    """

    tokens: list[list[int]]
    prompt_lengths: tuple[int, ...]
    stopped: tuple[bool, ...] = ()
    logprobs: tuple[tuple[float, ...], ...] = ()

    @property
    def new_tokens(self) -> list[list[int]]:
        """Only the generated tokens of each row."""
        return [row[n:] for row, n in zip(self.tokens, self.prompt_lengths, strict=True)]

    @property
    def prompt_tokens(self) -> list[list[int]]:
        """Only the prompt of each row."""
        return [row[:n] for row, n in zip(self.tokens, self.prompt_lengths, strict=True)]


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


def default_config(rows: int, max_len: int, max_new_tokens: int, *, longest: int | None = None,
                   block_size: int = 16) -> EngineConfig:
    """The engine generate builds for rows prompts of a model of max_len positions.

    The batch is rounded up to a power of two so that calls of similar sizes share
    one compiled program, and every prompt is written in the same prefill call;
    blocks of block_size positions (fewer for a very short model) and enough of
    them for every row at the length it reaches: its longest prompt (longest;
    None: a prompt as long as the model) plus max_new_tokens, rounded up to a
    power of two so that similar calls share programs, never past max_len. A
    checkpoint that reads a million positions does not lay out a million-position
    cache per row for a short reply. No more decode batch sizes than there are
    decode calls to use them.
    """
    batch = 1 << max(rows - 1, 0).bit_length()
    rounds = -(-max_new_tokens // EngineConfig.steps_per_call)
    reach = max_len if longest is None else longest + max_new_tokens
    length = min(max_len, max(block_size, 1 << max(reach - 1, 0).bit_length()))
    return EngineConfig(max_batch=batch, block_size=min(block_size, length), max_len=length,
                        prefill_rows=batch, batch_buckets=max(1, min(4, rounds)))


def generate(
    model: nn.Module,
    params: Mapping[str, Any],
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    max_new_tokens: int,
    key: jax.Array,
    sampling: Sampling = Sampling(),
    *,
    eos_id: int | Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    detokenize: Callable[[Sequence[int]], str] | None = None,
    vocab: int | None = None,
    config: EngineConfig | None = None,
) -> Generation:
    """Continue each prompt by max_new_tokens tokens.

    model is a causal decoder with a paged decode path (``CausalTransformer``),
    params its full variables (``state.params``; partitioned boxes are
    accepted), prompts a list of token-id sequences, possibly of different
    lengths, or a 2-D array. key drives the random draws (unused when
    sampling is greedy); row i draws with ``fold_in(key, i)``. With eos_id (an
    id, or several: a checkpoint's eos_token_id list), a row stops after
    producing one; with stop_strings (and detokenize, ids ->
    text) once its text contains one; it may then hold fewer than
    max_new_tokens new tokens. vocab keeps draws below it (the tokenizer's
    vocabulary, where the model's is padded past it). config overrides the engine's layout
    (default_config).
    """
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
            or max_new_tokens < 0:
        raise InvalidPromptError(f"max_new_tokens must be a non-negative integer, got "
                                 f"{max_new_tokens!r}.")
    max_new_tokens = int(max_new_tokens)
    rows = _rows(prompts)
    rows_of = getattr(model, "vocab_size", None)  # any decoder; dew's name their vocabulary
    outside = [] if rows_of is None else [i for i, row in enumerate(rows) if not all(0 <= t < rows_of for t in row)]
    if rows_of is not None and outside:
        raise InvalidPromptError(
            f"Prompts {outside} hold token ids outside the model's vocabulary of {rows_of} ids (0 to "
            f"{rows_of - 1}); encode them with the tokenizer the model was trained with.")
    lengths = [len(row) for row in rows]
    limit = (config.max_len if config is not None and config.max_len else None) or model.max_seq_len
    if max(lengths) + max_new_tokens > limit:
        longest = max(lengths)
        raise PromptTooLongError(
            f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is "
            f"{longest + max_new_tokens} tokens, more than the model's max_seq_len={limit}. "
            + (f"Ask for at most {limit - longest} new tokens or shorten the prompt." if longest < limit else
               f"Shorten the prompt to fewer than {limit} tokens.")
        )
    if max_new_tokens == 0:
        return Generation([list(row) for row in rows], tuple(lengths), (False,) * len(rows),
                          ((),) * len(rows))
    stops = () if eos_id is None else tuple(int(i) for i in (eos_id if isinstance(eos_id, Sequence) else [eos_id]))
    if config is None:
        config = default_config(len(rows), limit, max_new_tokens, longest=max(lengths))
        config = dataclasses.replace(config, max_stop_tokens=max(config.max_stop_tokens, len(stops)))
    engine = Engine(model, config, detokenize=detokenize, vocab=vocab)
    engine.set_params(params)
    for i, row in enumerate(rows):
        request = Request(tuple(row), max_new_tokens, sampling=sampling, stop_tokens=stops,
                          stop_strings=tuple(stop_strings))
        engine.submit(request, jax.random.fold_in(key, i))
    done = engine.run()
    return Generation([row + list(c.tokens) for row, c in zip(rows, done, strict=True)],
                      tuple(lengths), tuple(c.finish != "length" for c in done),
                      tuple(c.logprobs for c in done))
