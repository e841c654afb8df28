"""What goes into the generation engine and what comes out: its settings, requests, completions.

All frozen: a request is a value, and so is an engine's snapshot (every
unfinished sequence with what it produced so far), which a later engine
restores and continues as if never stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dew.sampling.errors import EngineConfigError, InvalidPromptError
from dew.sampling.options import Sampling

__all__ = ["Completion", "EngineConfig", "EngineSnapshot", "EngineStats", "Finish", "Request",
           "SequenceState"]

Finish = Literal["stop_token", "stop_string", "length"]


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine lays out its cache and batches its work; each setting fixes a shape.

    max_batch sequences decode at once (the decode program's rows at most; with
    batch_buckets above 1 it also compiles for halves of that, down to
    min_bucket rows, and runs the smallest that holds the sequences left).
    The cache holds num_blocks blocks of block_size positions (None: enough
    for max_batch sequences of max_len positions each, the memory a static
    batch would take); one sequence holds at most max_len positions (None: the
    model's max_seq_len). A prompt is written prefill_chunk positions at a
    time, prefill_rows prompts per call; a decode call runs steps_per_call
    tokens on the device before the host looks again. A request names at most
    max_stop_tokens stop tokens. share_prefixes: the samples of a request share
    its prompt's blocks, and full blocks already written for the same tokens
    are reused instead of computed again.
    """

    max_batch: int = 64
    block_size: int = 16
    num_blocks: int | None = None
    max_len: int | None = None
    prefill_chunk: int = 256
    prefill_rows: int = 4
    steps_per_call: int = 8
    batch_buckets: int = 4
    min_bucket: int = 8
    max_stop_tokens: int = 4
    share_prefixes: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch", "block_size", "prefill_chunk", "prefill_rows", "steps_per_call",
                     "batch_buckets", "min_bucket", "max_stop_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise EngineConfigError(f"EngineConfig.{name} must be a positive integer, got "
                                        f"{value!r}.")
        for name in ("num_blocks", "max_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise EngineConfigError(f"EngineConfig.{name} must be a positive integer or None, "
                                        f"got {value!r}.")

    def blocks_per_sequence(self, max_len: int) -> int:
        """The block table's width: the blocks max_len positions take."""
        return math.ceil(max_len / self.block_size)

    def pool_blocks(self, max_len: int) -> int:
        """The cache's size in blocks (block 0 is the tables' padding and never holds data)."""
        need = self.blocks_per_sequence(max_len) + 1
        if self.num_blocks is None:
            return self.max_batch * (need - 1) + 1
        if self.num_blocks < need:
            raise EngineConfigError(
                f"EngineConfig.num_blocks={self.num_blocks} cannot hold one sequence of "
                f"max_len={max_len} positions in blocks of {self.block_size} (that takes "
                f"{need - 1} blocks plus one reserved); use num_blocks >= {need}."
            )
        return self.num_blocks

    def buckets(self) -> tuple[int, ...]:
        """The decode batch sizes compiled, smallest first."""
        sizes = {self.max_batch}
        size = self.max_batch
        for _ in range(self.batch_buckets - 1):
            size = math.ceil(size / 2)
            if size < self.min_bucket:
                break
            sizes.add(size)
        return tuple(sorted(sizes))


@dataclass(frozen=True)
class Request:
    """One prompt to continue samples times (a GRPO group: its samples share the prompt's cache).

    max_new_tokens bounds each sample's new tokens; a sample also ends after
    producing one of stop_tokens (kept as its last token) or once its text
    contains one of stop_strings (the engine needs a detokenize function then;
    the tokens end with the one that completed the string). keep_cache: a
    finished sample keeps its cache blocks, so ``Engine.extend`` continues it
    after more tokens (an environment's answer) without writing its tokens
    again; ``Engine.release`` lets them go.
    """

    prompt: tuple[int, ...]
    max_new_tokens: int
    samples: int = 1
    sampling: Sampling = Sampling()
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    keep_cache: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str | bytes):
            raise InvalidPromptError("A request's prompt is token ids, not text; encode the text with the "
                                     "model's tokenizer first.")
        try:
            prompt = tuple(int(t) for t in self.prompt)
        except (TypeError, ValueError):
            raise InvalidPromptError(f"A request's prompt is a sequence of integer token ids; got "
                                     f"{self.prompt!r:.80}.") from None
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not prompt:
            raise InvalidPromptError("A request's prompt is empty; every prompt needs at least one "
                                     "token (for example a beginning-of-text id).")
        if min(prompt) < 0:
            raise InvalidPromptError(f"A prompt holds the negative token id {min(prompt)}.")
        if isinstance(self.max_new_tokens, bool) or int(self.max_new_tokens) != self.max_new_tokens \
                or self.max_new_tokens < 0:
            raise InvalidPromptError(f"max_new_tokens must be a non-negative integer, got "
                                     f"{self.max_new_tokens!r}.")
        if isinstance(self.samples, bool) or int(self.samples) != self.samples or self.samples < 1:
            raise InvalidPromptError(f"Request.samples must be a positive integer, got "
                                     f"{self.samples!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise InvalidPromptError(f"stop_strings must be non-empty strings, got "
                                     f"{self.stop_strings!r}.")


@dataclass(frozen=True)
class Completion:
    """One sample of one request: its new tokens, their log-probabilities, and why it ended.

    id numbers sequences in the order they were submitted (a request of n
    samples takes n consecutive ids); request is what submit returned, sample
    the index within the request. logprobs are the model's own log-probability
    of each new token (temperature 1, no filter); a policy-gradient ratio to the
    policy that sampled at another temperature divides by the tempered one
    instead (dew.objectives.policy.token_logprobs with that temperature).
    """

    id: int
    request: int
    sample: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: Finish
    preemptions: int = 0


@dataclass(frozen=True)
class SequenceState:
    """An unfinished sequence as a snapshot keeps it: enough to continue it exactly."""

    id: int
    request: int
    sample: int
    spec: Request
    key: tuple[int, ...]
    generated: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    preemptions: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything an engine still owes, in order: restore it into another engine to continue."""

    sequences: tuple[SequenceState, ...]
    next_id: int
    next_request: int
    key_impl: str


@dataclass(frozen=True)
class EngineStats:
    """Counts of an engine's work since it was built."""

    prefill_calls: int = 0
    decode_calls: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    copies: int = 0
    evictions: int = 0
