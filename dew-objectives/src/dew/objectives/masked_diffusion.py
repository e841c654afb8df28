"""Masked (absorbing-state) diffusion over token ids: MDLM's continuous-time ELBO.

A batch holds token windows under "text" ([B, seq_len], or token_windows'
[B, seq_len + 1] of which the first seq_len are used). Each row is noised at
its own time t (stratified over the batch) by masking each token with
probability t; the model (a ``TokenDenoiser``) predicts the masked tokens,
and the loss is the negative ELBO per token: the sum over masked tokens of
(1/t) times their cross-entropy, divided by the number of tokens. Previews
sample with ``dew.sampling.masked_generate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from dew.diffusion.masking import check_temperature, mask_tokens, nelbo_weight, stratified_times
from dew.errors import BatchKeyError
from dew.nn.kinds import TokenModel
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
from dew.sampling.masked import masked_generate
from dew.telemetry.artifacts import Artifact
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.objectives import diffusion_pipeline
    from dew.training.state import TrainState

__all__ = [
    "InvalidTokensError",
    "MaskedDiffusionObjective",
    "TokenDiffusion",
    "masked_cross_entropy",
    "token_windows",
]


# Token windows missing, or of the wrong shape or dtype: dew's one batch-key error.
InvalidTokensError = BatchKeyError


def token_windows(batch: Batch, seq_len: int, owner: str) -> jax.Array:
    """The first seq_len ids of each window under "text", checked."""
    if "text" not in batch:
        raise InvalidTokensError(f"{owner} reads token ids under the batch key 'text', but the batch "
                                 f"has keys {sorted(batch)}.")
    text = batch["text"]
    shape = tuple(getattr(text, "shape", ()))  # a batch value is whatever the reader yields
    if len(shape) != 2 or shape[1] not in (seq_len, seq_len + 1):
        raise InvalidTokensError(f"Batch key 'text' has shape {shape}; {owner}(seq_len={seq_len}) "
                                 f"expects [batch, {seq_len}] (or token_windows' [batch, {seq_len + 1}]). In a "
                                 "recipe, give the data reader's length (data.length) the value of objective.seq_len.")
    if not jnp.issubdtype(text.dtype, jnp.integer):
        raise InvalidTokensError(f"Batch key 'text' holds {text.dtype}; token ids must be integers.")
    return jnp.asarray(text[:, :seq_len], jnp.int32)


def masked_cross_entropy(logits: jax.Array, tokens: jax.Array, masked: jax.Array,
                         weight: jax.Array) -> jax.Array:
    """weight times the cross-entropy of each masked token (0 elsewhere), per token."""
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
    return jnp.where(masked, weight * per_token, 0.0)


class TokenDiffusion(Objective):
    """What masked and block diffusion share: windows under "text", the NELBO per token, pipelines.

    A subclass gives per_token (the weighted loss of each token) and generate.
    """

    model: nn.Module
    seq_len: int
    tokenizer: Any

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """What the objective refuses in its own values (a block size that does not divide seq_len,
        no preview steps, a negative temperature), said by dew train --check before anything is
        built (dew.registry.ChecksFields); seq_len against the model's length waits for the model."""
        build: Any = cls  # a subclass's dataclass constructor (this base declares its fields only)
        try:
            build(model=None, **{name: value for name, value in fields.items() if name != "model"})
        except ValueError as error:
            return [((), str(error))]
        except TypeError:  # a field missing or of another type: the recipe's schema and the run say so
            pass
        return []

    @property
    def mask_id(self) -> int:
        """The absorbing state: the model's vocab_size."""
        return int(self.model.vocab_size)

    def required_keys(self) -> Sequence[str]:
        return ("text",)

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))

    def per_token(self, variables: Variables, tokens: jax.Array, key: jax.Array) -> jax.Array:
        raise NotImplementedError

    def generate(self, variables: Variables, key: jax.Array, rows: int, *,
                 steps: int | None = None, prefix: jax.Array | None = None) -> jax.Array:
        raise NotImplementedError

    def prefix_of(self, prompt: str, rows: int) -> jax.Array:
        """prompt's ids [rows, P] for generate's prefix; ValueError when it cannot start a sample."""
        from dew.objectives.diffusion_pipeline import prefix_ids

        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} has no tokenizer to read a prompt with.")
        return prefix_ids(self.tokenizer, prompt, rows, self.seq_len)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        """The negative ELBO per token (an upper bound on the NLL per token, in nats)."""
        tokens = token_windows(batch, self.seq_len, type(self).__name__)
        per_token = self.per_token(variables, tokens, step.key)
        return Mean(jnp.sum(per_token), jnp.asarray(per_token.size, jnp.float32)), Aux()

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        return {"loss": self.loss(variables, batch, step)[0]}

    def metrics(self) -> tuple[Metric, ...]:
        return (MeanMetric("loss"),)

    def decode(self, tokens: jax.Array) -> str:
        """Rows of ids as text, separated by a rule line."""
        return "\n---\n".join(self.tokenizer.decode([int(i) for i in row]) for row in tokens)

    def pipeline(self, state: TrainState | Variables, *, ema: bool = True) -> diffusion_pipeline.TextDiffusionPipeline:
        """A pipeline that writes text with state's (EMA) parameters (or given variables)."""
        from dew.objectives.diffusion_pipeline import TextDiffusionPipeline
        from dew.objectives.inference import variables_of

        return TextDiffusionPipeline(self, variables_of(state, ema))


@dataclass(frozen=True)
class MaskedDiffusionObjective(TokenDiffusion):
    """MDLM over windows of seq_len ids with a TokenDenoiser (mask id = its vocab_size)."""

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = TokenModel

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    t_min: float = 1e-3
    tokenizer: Any = None
    preview_rows: int = 2
    preview_steps: int = 64
    temperature: float = 1.0
    ema: EMASpec | None = None

    def __post_init__(self) -> None:
        # Any flax Module: one that does not say its max_seq_len bounds nothing.
        if self.seq_len < 1 or self.seq_len > getattr(self.model, "max_seq_len", self.seq_len):
            raise ValueError(f"{type(self).__name__}.seq_len={self.seq_len} must lie in [1, the "
                             f"model's max_seq_len={getattr(self.model, 'max_seq_len', '?')}].")
        if not 0.0 < self.t_min < 1.0:
            raise ValueError(f"t_min must lie in (0, 1), got {self.t_min}.")
        for name in ("preview_rows", "preview_steps"):  # a preview of 0 unmasking steps decodes mask ids
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be at least 1, got {getattr(self, name)}.")
        check_temperature(type(self).__name__, self.temperature)

    def per_token(self, variables: Variables, tokens: jax.Array, key: jax.Array) -> jax.Array:
        """(1/t) CE of each masked token, 0 for the rest, [B, seq_len]."""
        time_key, mask_key = jax.random.split(key)
        t = stratified_times(time_key, tokens.shape[0], self.t_min)[:, None]
        noisy, masked = mask_tokens(mask_key, tokens, t, self.mask_id)
        logits = self.model.apply(variables, noisy)
        return masked_cross_entropy(logits, tokens, masked, nelbo_weight(t))

    def generate(self, variables: Variables, key: jax.Array, rows: int, *,
                 steps: int | None = None, prefix: jax.Array | None = None) -> jax.Array:
        """rows samples of seq_len ids (prefix [rows, P] kept as their start)."""
        return masked_generate(self.model, variables, rows, self.seq_len, key,
                               steps=steps or self.preview_steps, temperature=self.temperature,
                               prefix=prefix)

    def preview(self, variables: Variables, key: jax.Array) -> Artifact | None:
        if self.tokenizer is None:
            return None
        tokens = jax.jit(lambda v, k: self.generate(v, k, self.preview_rows))(variables, key)
        return Artifact("sample", "text", self.decode(tokens))
