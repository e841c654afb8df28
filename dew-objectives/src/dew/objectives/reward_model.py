"""A Bradley-Terry reward model: a causal decoder with a scalar head, trained on preference pairs.

The score of a sequence is a linear map (``params/reward_head``) of the
decoder's last hidden state (the output of its ``features_module``,
``final_norm`` in dew's transformers) at the completion's last token. On
DPO's pairs (``chosen``, ``rejected``, their masks over the completion) the
loss per pair is Bradley and Terry's

    -log s(r(x, y_w) - r(x, y_l)) + center * (r(x, y_w) + r(x, y_l))^2

(the second term, Eisenstein et al. 2023's auxiliary loss, keeps the scores
centred on zero; off by default). ``pipeline`` scores text with the trained
weights, and the ``model`` reward (``dew.rewards.model``) scores an RL run's
completions with a trained reward-model run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.errors import DewError
from dew.families import scoring
from dew.nn.features import check_features_module, with_features
from dew.nn.kinds import CausalDecoder
from dew.objectives.base import Aux, Batch, Mean, MeanMetric, Metric, Objective, Step, Variables
from dew.objectives.dpo import PairCheck
from dew.objectives.inference import (
    Generated,
    GenerateRequest,
    Pipeline,
    UnsupportedRequestError,
    variables_of,
    write_texts,
)
from dew.objectives.policy import PolicyFrom, check_model_reach

if TYPE_CHECKING:
    from dew.pretrained.model import Pretrained as PretrainedModel
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["REWARD_HEAD", "RewardModelObjective", "RewardScoring", "SequenceTooLongError", "sequence_scores"]

REWARD_HEAD = scoring.HEAD  # where the layout of a published reward model keeps its score too


class SequenceTooLongError(DewError, ValueError):
    """A text to score is longer than the reward model reads."""


class ScalarHead(nn.Module):
    """One number per position from a hidden state.

    No bias: the Bradley-Terry loss sees only differences of scores, so a
    bias would get no gradient but rounding noise (transformers' sequence-
    classification heads leave it out too).
    """

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:
        dense = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.zeros, name="dense")
        return dense(hidden.astype(jnp.float32))[..., 0]


def _hidden(model: nn.Module, params: Variables, tokens: jax.Array, features_module: str) -> jax.Array:
    return with_features(model, params, tokens, features_module, head="the reward head",
                         field="RewardModelObjective(features_module=...)")[1]


def sequence_scores(model: nn.Module, variables: Variables, tokens: jax.Array, mask: jax.Array,
                    features_module: str = "final_norm") -> jax.Array:
    """The reward head's value [B] at each row's last position where mask is 1."""
    params = dict(variables["params"])
    head = params.pop(REWARD_HEAD)
    hidden = _hidden(model, {"params": params}, tokens, features_module)
    values = ScalarHead().apply({"params": head}, hidden)
    width = mask.shape[1]
    last = width - 1 - jnp.argmax(jnp.flip(jnp.asarray(mask) > 0, axis=1), axis=1)
    return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


@dataclass(frozen=True)
class RewardModelObjective(Objective):
    """Bradley-Terry on preference pairs (see the module docstring).

    metrics: ``accuracy`` (pairs whose chosen scores higher), ``margin``
    (the chosen's score less the rejected's), ``chosen_score`` and
    ``rejected_score``; a validation split reports them too.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder
    heads: ClassVar[tuple[str, ...]] = (REWARD_HEAD,)
    serves_scores: ClassVar[bool] = True  # its decoder's token logits never train

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    center: float = 0.0
    features_module: str = scoring.FEATURES
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    prompt_length_key: str = "prompt_length"
    tokenizer: Any = None

    def __post_init__(self) -> None:
        check_model_reach("RewardModelObjective", self.model, seq_len=self.seq_len)
        check_features_module(self.model, self.features_module, field="RewardModelObjective.features_module")

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The decoder's variables (given ones pass through) and a reward head initialized to zero."""
        model_key, head_key = jax.random.split(key)
        if variables is None:
            variables = self.model.init(model_key, jnp.zeros((1, 1), jnp.int32))
        params = dict(variables["params"])
        if REWARD_HEAD in params:
            return {"params": params}
        hidden = _hidden(self.model, {"params": params}, jnp.zeros((1, 1), jnp.int32), self.features_module)
        return {"params": {**params, REWARD_HEAD: ScalarHead().init(head_key, hidden)["params"]}}

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the decoder (the head starts fresh)."""
        return PolicyFrom(source, exclude=(REWARD_HEAD,))

    def rollout(self) -> PairCheck:
        """The host-side check a recipe runs before each step: pairs share their prompt."""
        return PairCheck(self.chosen_key, self.rejected_key, self.prompt_length_key)

    def required_keys(self) -> Sequence[str]:
        return (self.chosen_key, self.rejected_key, f"{self.chosen_key}_mask", f"{self.rejected_key}_mask")

    def scores(self, variables: Variables, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        """The score [B] of each row at its last masked position."""
        return sequence_scores(self.model, variables, tokens, mask, self.features_module)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        chosen, rejected = batch[self.chosen_key], batch[self.rejected_key]
        tokens = jnp.concatenate([chosen, rejected], axis=0)
        masks = jnp.concatenate([batch[f"{self.chosen_key}_mask"], batch[f"{self.rejected_key}_mask"]], axis=0)
        scores = self.scores(variables, tokens, masks)
        pairs = chosen.shape[0]
        r_c, r_r = scores[:pairs], scores[pairs:]
        losses = -jax.nn.log_sigmoid(r_c - r_r)
        if self.center:
            losses = losses + self.center * (r_c + r_r) ** 2
        metrics = {
            "accuracy": Mean.of((r_c > r_r).astype(jnp.float32)),
            "margin": Mean.of(r_c - r_r),
            "chosen_score": Mean.of(r_c),
            "rejected_score": Mean.of(r_r),
        }
        return Mean.of(losses), Aux(metrics=metrics)

    def metrics(self) -> tuple[Metric, ...]:
        """The validation metrics: the loss, the pair accuracy and margin, and both sides' mean scores."""
        return (MeanMetric("loss"), MeanMetric("accuracy"), MeanMetric("margin"),
                MeanMetric("chosen_score"), MeanMetric("rejected_score"))

    def pipeline(self, state: TrainState | Variables) -> RewardScoring:
        """Score texts with state's weights (a TrainState or a variables tree; the EMA copy when kept)."""
        return RewardScoring(self, {"params": variables_of(state)["params"]})


class RewardScoring(Pipeline):
    """Texts to the reward model's scores: ``scoring(["3+4=7\\n", ...])`` -> float32 [N].

    As the run's pipeline, ``dew generate RUN TEXT...`` prints each text's
    score before it.

    Each text is encoded with the objective's tokenizer (UTF-8 bytes without
    one, as dew's byte-level models read them) and scored at its last token.
    Rows are padded to a width of a power of two, so a handful of programs
    serve every length the model reads.
    """

    def __init__(self, objective: RewardModelObjective, variables: Variables) -> None:
        self.objective = objective
        self.variables = variables
        self.max_length = int(getattr(objective.model, "max_seq_len", objective.seq_len))  # any flax Module

    accepts: ClassVar[str] = "one or more texts to score"

    def generate(self, request: GenerateRequest) -> Generated:
        """Each input text's score, shown as ``score<TAB>text``."""
        self.check(request)
        if not request.inputs:
            raise UnsupportedRequestError(f"No text was given: {self.describe()}.")
        scores = self(list(request.inputs))
        shown = tuple(f"{float(score):.4f}\t{text}" for score, text in zip(scores, request.inputs, strict=True))
        return Generated(texts=shown, files=write_texts(shown, request.out), samples=len(shown))

    def usage(self, run: object) -> str:
        return f"dew generate {run} TEXT"

    def pretrained(self) -> PretrainedModel:
        """The decoder, its head and the objective (the task) as a Pretrained, which ``Pretrained.load``
        reads back into this pipeline: saved as its family's sequence-classification model
        (``dew.families.scoring``) where the decoder is exactly a family's, else in dew's own layout."""
        from dew.pretrained.native import objective_pretrained

        return objective_pretrained(self.objective, self.variables)

    def encode(self, text: str) -> list[int]:
        """text as a whole sequence, started as the training prompts were (dew.data.base.prompt_ids)."""
        from dew.data.base import prompt_ids

        tokenizer = self.objective.tokenizer
        return prompt_ids(tokenizer, text) if tokenizer is not None else list(text.encode("utf-8"))

    def __call__(self, texts: str | Sequence[str], *, batch: int = 64) -> np.ndarray:
        """The score of each text, in order."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        ids = [self.encode(t) for t in texts]
        for i, row in enumerate(ids):
            if not row or len(row) > self.max_length:
                shown = texts[i] if len(texts[i]) <= 80 else f"{texts[i][:60]}...{texts[i][-16:]}"
                raise SequenceTooLongError(
                    f"Text {i} ({shown!r}, {len(texts[i])} characters) is {len(row)} tokens; the reward model "
                    f"scores texts of 1 to {self.max_length} tokens (its max_seq_len). Score shorter texts: an "
                    "RL run's prompt and completion together (a shorter data.length or objective.max_new_tokens), "
                    "or use a reward model that reads longer ones."
                )
        out = []
        for start in range(0, len(ids), batch):
            part = ids[start:start + batch]
            width = min(max(8, 1 << (max(map(len, part)) - 1).bit_length()), self.max_length)
            tokens = np.zeros((len(part), width), np.int32)
            mask = np.zeros((len(part), width), np.float32)
            for i, row in enumerate(part):
                tokens[i, :len(row)] = row
                mask[i, :len(row)] = 1.0
            out.append(np.asarray(self._score(self.variables, jnp.asarray(tokens), jnp.asarray(mask))))
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0,), np.float32)

    @functools.cached_property
    def _score(self) -> Callable[[Variables, jax.Array, jax.Array], jax.Array]:
        return jax.jit(self.objective.scores)
