"""Autoregressive language modelling: predict each token from the ones before it.

A batch holds token windows of seq_len + 1 ids under "text"; the model reads
the first seq_len and is scored on predicting the seq_len that follow, one
position later.

Supervised fine-tuning adds two optional keys of the same shape as "text":

- "loss_mask": 1 where a token is to be predicted (a completion), 0 where
  it is only read (a prompt, padding). A target scores only when its mask
  is 1, so masked positions give exactly zero gradient.
- "segment_ids": the number of the document each token belongs to, when
  several are packed into one row (0 marks padding). Attention stays inside
  a document, positions restart at each document's first token, and a
  document's last token is not asked to predict the next document's first.
  The model must accept ``positions`` and ``segment_ids`` (CausalTransformer
  does).

``dew.data.prompt_completion`` reads prompt/completion records into such rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data.base import (  # what LMObjective needs of one to render previews
    Tokenizer,
    prompt_ids,
    stop_ids_of,
)
from dew.data.tokenizers import drawable_vocab
from dew.errors import BatchKeyError, DewError
from dew.nn.kinds import CausalDecoder
from dew.nn.moe import MOE_COLLECTION, moe_statistics
from dew.objectives.base import (
    Aux,
    Batch,
    EMASpec,
    Mean,
    MeanMetric,
    Metric,
    Objective,
    Step,
    Variables,
)
from dew.sampling import Sampling, TextGeneration, generate
from dew.telemetry.artifacts import Artifact
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.training.state import TrainState

__all__ = ["BatchShapeError", "LMObjective", "MissingBatchKeyError", "Perplexity", "TokenRangeError",
           "Tokenizer", "argmax_hits", "scored_targets", "segment_positions"]


# A batch without the key the loss reads, or with it misshapen: dew's one batch-key error.
MissingBatchKeyError = BatchKeyError
BatchShapeError = BatchKeyError


class TokenRangeError(DewError, ValueError):
    """A batch holds token ids outside the model's vocabulary."""


@dataclass(frozen=True)
class Perplexity:
    """exp of the mean next-token cross-entropy over a validation pass."""

    name: str = "perplexity"
    output: str = "loss"

    def empty(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def update(self, accumulator: tuple[float, float],
               outputs: Mapping[str, PyTree]) -> tuple[float, float]:
        return MeanMetric(self.name, self.output).update(accumulator, outputs)

    def result(self, accumulator: tuple[float, float]) -> float:
        total, count = accumulator
        return math.exp(total / count) if count else math.nan


@dataclass(frozen=True)
class LMObjective(Objective):
    """Next-token cross-entropy of a causal model over windows of seq_len + 1 ids.

    loss reports the mean cross-entropy per predicted token and, as a
    metric, the fraction of tokens whose most likely prediction is right.
    A model with experts (CausalTransformer(experts=...)) also reports its
    routers' load_balancing_loss, router_z_loss and dropped_fraction
    (averaged over its MoE layers), and trains on cross-entropy +
    expert_loss_weight times the balance loss + router_z_loss_weight times
    the z-loss (ST-MoE's 1e-3 by default); evaluation scores the
    cross-entropy alone.
    With a tokenizer and a prompt, preview continues the prompt by
    preview_tokens tokens with preview_sampling and returns it as text.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    tokenizer: Tokenizer | None = None
    prompt: str | None = None
    ema: EMASpec | None = None
    preview_tokens: int = 64
    preview_sampling: Sampling = Sampling(temperature=0.0)
    expert_loss_weight: float = 0.01
    router_z_loss_weight: float = 1e-3

    def __post_init__(self) -> None:
        if isinstance(self.preview_sampling, Mapping):  # a recipe's {temperature: ..., top_k: ...}
            object.__setattr__(self, "preview_sampling", Sampling(**self.preview_sampling))
        if self.expert_loss_weight < 0:
            raise ValueError(f"LMObjective.expert_loss_weight must be >= 0, got "
                             f"{self.expert_loss_weight}; 0 reports the balance loss without "
                             "training on it.")
        if self.router_z_loss_weight < 0:
            raise ValueError(f"LMObjective.router_z_loss_weight must be >= 0, got "
                             f"{self.router_z_loss_weight}; 0 reports the router z-loss without "
                             "training on it.")
        if self.seq_len < 1:
            raise ValueError(f"LMObjective.seq_len must be at least 1, got {self.seq_len}.")
        if self.preview_tokens < 0:
            raise ValueError(f"LMObjective.preview_tokens must be at least 0 (0 previews the prompt alone), "
                             f"got {self.preview_tokens}.")
        if self.prompt is not None and self.tokenizer is not None and not prompt_ids(self.tokenizer, self.prompt):
            raise ValueError(f"LMObjective.prompt={self.prompt!r} gives the preview no token to start from (the "
                             "tokenizer adds no beginning-of-text id): give text to continue, or null for no preview.")
        limit = getattr(self.model, "max_seq_len", None)  # any flax Module: a family without it is not checked
        if limit is not None and self.seq_len > limit:
            raise ValueError(
                f"LMObjective.seq_len={self.seq_len} exceeds the model's max_seq_len={limit}; "
                "shorten the windows or build a model with a longer max_seq_len."
            )
        if self.tokenizer is not None:
            from dew.pretrained import check_vocabulary

            check_vocabulary(self.tokenizer, self.model)

    # -- the Objective protocol --------------------------------------------------
    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The model's variables for windows of seq_len tokens (given variables pass through)."""
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))

    def required_keys(self) -> Sequence[str]:
        return ("text",)

    def check_batch(self, batch: Mapping[str, np.ndarray], step: int) -> None:
        """Token ids must lie in [0, the model's vocab_size): refused before the step, by name."""
        vocab = getattr(self.model, "vocab_size", None)  # any flax Module: a family without it is not checked
        text = batch.get("text")
        if vocab is None or text is None or not isinstance(text, np.ndarray | jax.Array):
            return
        if not jnp.issubdtype(text.dtype, jnp.integer):
            raise BatchShapeError(f"Batch key 'text' of step {step} holds {text.dtype}; token ids "
                                  "must be integers.")
        high, low = int(text.max(initial=0)), int(text.min(initial=0))
        if high >= vocab or low < 0:
            raise TokenRangeError(
                f"Batch key 'text' of step {step} holds token id {high if high >= vocab else low}, "
                f"outside the model's vocabulary of {vocab} ids (0 to {vocab - 1}). The tokenizer "
                f"makes more ids than the model has rows: build the model with vocab_size of at "
                f"least {high + 1}, or use the tokenizer it was built for."
            )

    def tokens(self, batch: Mapping[str, jax.ShapeDtypeStruct]) -> int | None:
        """The predicted tokens of a global batch: seq_len per row."""
        return int(batch["text"].shape[0]) * self.seq_len if "text" in batch else None

    def flops(self, batch: Mapping[str, jax.ShapeDtypeStruct]) -> float | None:
        """The model's training FLOPs per token, times the batch's tokens (when the model says)."""
        per_token = getattr(self.model, "flops_per_token", None)  # any flax Module: None if it does not say
        tokens = self.tokens(batch)
        if per_token is None or tokens is None:
            return None
        return float(per_token(self.seq_len)) * tokens

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        """Total cross-entropy over the scored tokens, and the accuracy as a Mean."""
        per_token, correct, weights, routing = self._score(variables, batch)
        loss = Mean.of(per_token, weights)
        metrics: dict[str, Mean | jax.Array] = {"accuracy": Mean.of(correct, weights)}
        if routing:
            # The balance loss is a per-batch scalar: weighting it by the token count keeps
            # it a mean per token when microbatches and shards sum their totals.
            for name, value in routing.items():
                metrics[name] = Mean(value * loss.count, loss.count)
            extra = self.expert_loss_weight * routing["load_balancing_loss"]
            if "router_z_loss" in routing:
                extra = extra + self.router_z_loss_weight * routing["router_z_loss"]
            loss = Mean(loss.total + extra * loss.count, loss.count)
        return loss, Aux(metrics=metrics)

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        """The loss and the accuracy as Means; Perplexity() reduces "loss" to exp(loss).

        The loss here is the cross-entropy alone, without an MoE balance term.
        """
        per_token, correct, weights, _ = self._score(variables, batch)
        return {"loss": Mean.of(per_token, weights), "accuracy": Mean.of(correct, weights)}

    def metrics(self) -> tuple[Metric, ...]:
        """The validation metrics this objective's evaluate outputs support."""
        return (MeanMetric("loss"), MeanMetric("accuracy"), Perplexity())

    def preview(self, variables: Variables, key: jax.Array) -> Artifact | None:
        """The prompt continued by the model, as text; None without a tokenizer and prompt."""
        if self.tokenizer is None or self.prompt is None:
            return None
        prompt = prompt_ids(self.tokenizer, self.prompt)  # as dew generate starts it
        limit = getattr(self.model, "max_seq_len", len(prompt) + self.preview_tokens)  # any flax Module
        new = max(min(self.preview_tokens, limit - len(prompt)), 0)
        out = generate(self.model, variables, [prompt], new, key, self.preview_sampling,
                       eos_id=stop_ids_of(self.tokenizer), vocab=drawable_vocab(self.tokenizer))
        from dew.sampling.text import continued

        # read after the prompt, as dew generate shows it (a SentencePiece decoder strips a leading space)
        return Artifact("sample", "text", self.prompt + continued(self.tokenizer.decode, prompt, out.new_tokens[0]))

    def pipeline(self, state: TrainState | Variables, *,
                 sampling: Sampling | Mapping[str, Any] | None = None) -> TextGeneration:
        """Text generation with state's weights: the EMA copy when the run kept one.

        state is a TrainState (or a variables tree). The pipeline samples as
        preview_sampling unless sampling (a Sampling, or its fields as a
        mapping) is given; its save writes the weights through Pretrained.save.
        """
        from dew.objectives.policy import policy_pipeline

        return policy_pipeline(self.model, state, self.tokenizer,
                               sampling=sampling or self.preview_sampling)

    # -- internals ---------------------------------------------------------------------
    def _windows(self, batch: Batch) -> jax.Array:
        if "text" not in batch:
            raise MissingBatchKeyError(
                f"LMObjective reads token windows under the batch key 'text', but the batch "
                f"has keys {sorted(batch)}; yield {{'text': int32 [batch, {self.seq_len + 1}]}}."
            )
        text = batch["text"]
        expected = ("batch", self.seq_len + 1)
        if np.ndim(text) != 2 or np.shape(text)[1] != self.seq_len + 1:
            raise BatchShapeError(
                f"Batch key 'text' has shape {tuple(np.shape(text))}, but "
                f"LMObjective(seq_len={self.seq_len}) expects {expected}: seq_len + 1 ids per "
                "row (inputs are the first seq_len, targets the last seq_len). In a recipe, give the data "
                "reader's length (data.length) the value of objective.seq_len."
            )
        if not jnp.issubdtype(text.dtype, jnp.integer):
            raise BatchShapeError(
                f"Batch key 'text' holds {text.dtype}; token ids must be integers (int32)."
            )
        return jnp.asarray(text, jnp.int32)

    def _score(self, variables: Variables, batch: Batch
               ) -> tuple[jax.Array, jax.Array, jax.Array | None, dict[str, jax.Array]]:
        text = self._windows(batch)
        inputs, targets = text[:, :-1], text[:, 1:]
        params = {name: value for name, value in variables.items()
                  if name not in ("cache", MOE_COLLECTION)}
        weights, read = scored_targets(batch, text)
        # Only a model that declares experts is applied with the "moe" collection mutable,
        # so a model (or wrapper) that knows nothing of it is called exactly as before.
        routed = bool(getattr(self.model, "experts", 0))  # any flax Module: only MoE families route
        options: dict[str, Any] = {"mutable": [MOE_COLLECTION]} if routed else {}
        if read is None:
            out = self.model.apply(params, inputs, **options)
        else:
            out = self.model.apply(params, inputs, segment_positions(read), segment_ids=read,
                                   **options)
        logits, routing = (out[0], moe_statistics(out[1])) if routed else (out, {})
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        if weights is not None:  # a masked position contributes an exact zero, never a NaN
            per_token = jnp.where(weights, per_token, 0.0)
        correct = argmax_hits(logits, targets)
        return per_token, correct, weights, routing


def scored_targets(batch: Batch, text: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
    """Which targets text[:, 1:] count (None: all of them), and the segment ids of the inputs
    text[:, :-1] (None: one document a row), from the batch's ``loss_mask`` and ``segment_ids``.

    Both keys hold one value per token of text ([batch, seq_len + 1]), as dew's readers write
    them: a target counts where its mask is set and it continues its own document (a packed
    row's first token of the next document, and padding, segment 0, do not).
    """
    def aligned(key: str) -> jax.Array | None:
        if key not in batch:
            return None
        value = batch[key]
        if tuple(np.shape(value)) != tuple(text.shape):
            raise BatchShapeError(
                f"Batch key {key!r} has shape {tuple(np.shape(value))}; it must match "
                f"'text' {tuple(text.shape)}, one value per token."
            )
        return jnp.asarray(value, jnp.int32)

    weights, read = None, None
    segments = aligned("segment_ids")
    if segments is not None:
        read = segments[:, :-1]
        weights = (segments[:, 1:] == read) & (segments[:, 1:] != 0)
    mask = aligned("loss_mask")
    if mask is not None:
        weights = (mask[:, 1:] != 0) if weights is None else weights & (mask[:, 1:] != 0)
    return weights, read


def argmax_hits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``argmax(logits, -1) == targets``, ties going to the first index as argmax's do, without
    argmax: XLA:CPU runs argmax's value-and-index reduction unvectorized, which made it the
    costliest part of the accuracy a training step logs. A hit is a target whose logit is the
    row's largest with no earlier entry equal to it (a row holding a NaN counts as a miss).

    >>> import jax.numpy as jnp
    >>> logits = jnp.asarray([[0.0, 2.0, 2.0], [1.0, 0.0, 0.0]])
    >>> argmax_hits(logits, jnp.asarray([2, 0])).tolist()
    [False, True]
    """
    top = jnp.max(logits, axis=-1, keepdims=True)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    earlier = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1) < targets[..., None]
    tied_before = jnp.any((logits == top) & earlier, axis=-1)
    return (target == top)[..., 0] & ~tied_before


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its own document (0 at every document's first token).

    >>> import jax.numpy as jnp
    >>> segment_positions(jnp.asarray([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
