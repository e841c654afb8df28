"""KTO: unpaired completions labelled desirable or not, against a reference point.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization". A batch holds single completions (``completion``: prompt then
completion, right-padded, int32 [B, L]; ``completion_mask``: 1 on the
completion's tokens; ``prompt_length`` [B]) and a ``label`` per row: 1 for a
desirable completion, 0 for an undesirable one. With r = log pi(y|x) -
log pi_ref(y|x) summed over the completion and z0 the reference point,

    L = lambda_y - v(x, y),   v = lambda_D s(beta (r - z0))  if desirable
                                  lambda_U s(beta (z0 - r))  if undesirable

averaged over the batch. z0 estimates KL(pi || pi_ref) from mismatched
pairs (each prompt followed by another row's completion: row i takes row
i - 1's), as max(0, mean of their log-ratios), without gradient. The
host-side step (``KTOBatch``, the objective's rollout) checks the labels and
builds the mismatched pairs (``kl_completion``, ``kl_completion_mask``); a
mismatched completion longer than the row's room is cut at the row's width.
Validation batches do not pass through the rollout, so ``evaluate`` builds
the same pairs in the compiled program (``mismatched_in_graph``).
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

from dew.data.base import Batch as HostBatch
from dew.errors import DewError
from dew.nn.kinds import CausalDecoder
from dew.objectives.base import Aux, Batch, LeafFilter, Mean, Objective, Step, Variables, under
from dew.objectives.dpo import sequence_logprob
from dew.objectives.policy import (
    REFERENCE,
    PolicyFrom,
    check_model_reach,
    policy_pipeline,
    policy_variables,
    reference_variables,
    with_reference,
)
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.sampling import Sampling, TextGeneration
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["KTOBatch", "KTOObjective", "LabelError", "LoneRowError", "mismatched", "mismatched_in_graph"]


class LabelError(DewError, ValueError):
    """KTO data without a label per completion, or with labels other than 0 and 1."""


class LoneRowError(DewError, ValueError):
    """A KTO batch of one row, whose KL estimate would pair the row with itself."""


def _refuse_lone_row(rows: int) -> None:
    if rows < 2:
        raise LoneRowError(
            "KTO estimates its KL term from each completion under another row's prompt, and a batch of "
            f"{rows} row has no other (its estimate would be the row's own log-ratio, and the loss 0.5 "
            "whenever that is positive). Give each step (each process's share of it) at least 2 rows.")


def mismatched(tokens: np.ndarray, mask: np.ndarray, prompt_length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's prompt followed by the previous row's completion (cut at the width), and its mask.

    >>> t, m = mismatched(np.array([[1, 2, 7, 0], [3, 8, 9, 0]]), np.array([[0, 0, 1, 0], [0, 1, 1, 0]]),
    ...                   np.array([2, 1]))
    >>> t.tolist(), m.tolist()
    ([[1, 2, 8, 9], [3, 7, 0, 0]], [[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    """
    rows, width = tokens.shape
    _refuse_lone_row(rows)
    out = np.zeros_like(tokens)
    out_mask = np.zeros(mask.shape, np.float32)
    for i in range(rows):
        j = (i - 1) % rows
        n = int(prompt_length[i])
        completion = tokens[j][np.asarray(mask[j]) > 0][: max(width - n, 0)]
        out[i, :n] = tokens[i, :n]
        out[i, n:n + completion.size] = completion
        out_mask[i, n:n + completion.size] = 1.0
    return out, out_mask


def mismatched_in_graph(tokens: jax.Array, mask: jax.Array, prompt_length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``mismatched`` as traceable jax operations, for batches that skip the host-side rollout.

    >>> t, m = mismatched_in_graph(jnp.array([[1, 2, 7, 0], [3, 8, 9, 0]]), jnp.array([[0, 0, 1, 0], [0, 1, 1, 0]]),
    ...                            jnp.array([2, 1]))
    >>> t.tolist(), m.tolist()
    ([[1, 2, 8, 9], [3, 7, 0, 0]], [[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    """
    _refuse_lone_row(tokens.shape[0])
    width = tokens.shape[1]
    kept = jnp.asarray(mask) > 0
    # Each row's completion tokens moved to its front, in order; then each row takes the previous row's.
    order = jnp.argsort(jnp.logical_not(kept).astype(jnp.int32), axis=1, stable=True)
    completions = jnp.roll(jnp.take_along_axis(tokens, order, axis=1), 1, axis=0)
    counts = jnp.roll(jnp.sum(kept, axis=1), 1, axis=0)
    starts = jnp.asarray(prompt_length).reshape(-1, 1)
    position = jnp.arange(width)[None, :]
    offset = position - starts
    inside = (offset >= 0) & (offset < counts[:, None])
    taken = jnp.take_along_axis(completions, jnp.clip(offset, 0, width - 1), axis=1)
    out = jnp.where(position < starts, tokens, jnp.where(inside, taken, 0)).astype(tokens.dtype)
    return out, inside.astype(jnp.float32)


@dataclass(frozen=True)
class KTOBatch:
    """The host-side step before each KTO step: labels checked, mismatched pairs added."""

    completion_key: str = "completion"
    label_key: str = "label"
    prompt_length_key: str = "prompt_length"

    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, np.ndarray]:
        if self.label_key not in batch:
            raise LabelError(
                f"KTO reads each completion's label (1 desirable, 0 undesirable) under "
                f"KTOObjective.label_key={self.label_key!r}, but the batch holds {sorted(batch)}. Give "
                "the data a label per completion (the addition reader's form 'labelled' does), or set "
                "label_key to the key that holds them."
            )
        labels = np.asarray(batch[self.label_key]).reshape(-1)
        bad = np.flatnonzero((labels != 0) & (labels != 1))
        if bad.size:
            raise LabelError(
                f"KTOObjective.label_key={self.label_key!r} holds {labels[bad[0]].item()!r} at row {int(bad[0])}; "
                "a label is 1 (desirable) or 0 (undesirable)."
            )
        for name in (self.completion_key, f"{self.completion_key}_mask", self.prompt_length_key):
            if name not in batch:
                raise LabelError(f"KTO reads {name!r}, but the batch holds {sorted(batch)}.")
        tokens = np.asarray(batch[self.completion_key])
        kl, kl_mask = mismatched(tokens, np.asarray(batch[f"{self.completion_key}_mask"]),
                                 np.asarray(batch[self.prompt_length_key]).reshape(-1))
        return {**batch, f"kl_{self.completion_key}": kl, f"kl_{self.completion_key}_mask": kl_mask}


@dataclass(frozen=True)
class KTOObjective(Objective):
    """KTO on labelled completions against a frozen reference (see the module docstring).

    metrics: ``kl`` (the reference point z0), ``desirable_reward`` and
    ``undesirable_reward`` (beta r over each kind of row), and
    ``label_accuracy`` (rows on their label's side of the reference point).
    tokenizer (a recipe's reader supplies it) and stop_token make the trained
    policy text generation (``pipeline``).
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    completion_key: str = "completion"
    label_key: str = "label"
    prompt_length_key: str = "prompt_length"
    stop_token: int | None = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        check_model_reach("KTOObjective", self.model, seq_len=self.seq_len, stop_token=self.stop_token)
        if not 0 < self.beta < math.inf:  # NaN too
            raise ValueError(f"KTOObjective.beta must be a positive finite number, got {self.beta}.")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ValueError("KTOObjective.desirable_weight and undesirable_weight must be positive, got "
                             f"{self.desirable_weight} and {self.undesirable_weight}.")

    @property
    def reference_collection(self) -> str | None:
        """The collection holding the frozen copy of the starting policy."""
        return REFERENCE

    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]
        return under(REFERENCE)

    def check_rows(self, rows: int) -> None:
        """Refuse a batch of one row, which no other row's prompt pairs with (ChecksBatchRows)."""
        _refuse_lone_row(rows)

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The policy's variables (given ones pass through) and the reference's copy."""
        if variables is None:
            variables = self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))
        return with_reference(variables)

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the policy's parameters (the reference copies them)."""
        return PolicyFrom(source)

    def pipeline(self, state: TrainState | Variables, *, sampling: Sampling | Mapping[str, Any] | None = None) -> TextGeneration:
        """The policy (without its reference) as text generation, stopping at stop_token."""
        return policy_pipeline(self.model, state, self.tokenizer, sampling=sampling,
                               stop_token=self.stop_token)

    def rollout(self) -> KTOBatch:
        """The host-side step a recipe runs before each step: labels checked, mismatched pairs built."""
        return KTOBatch(self.completion_key, self.label_key, self.prompt_length_key)

    def required_keys(self) -> Sequence[str]:
        c = self.completion_key
        return (c, f"{c}_mask", self.label_key, f"kl_{c}", f"kl_{c}_mask")

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        """The loss and metrics on a held-out batch, its mismatched pairs built here (no rollout ran)."""
        c = self.completion_key
        if f"kl_{c}" not in batch:
            kl, kl_mask = mismatched_in_graph(batch[c], batch[f"{c}_mask"],
                                              jnp.reshape(batch[self.prompt_length_key], (-1,)))
            batch = {**batch, f"kl_{c}": kl, f"kl_{c}_mask": kl_mask}
        return super().evaluate(variables, batch, step)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        c = self.completion_key
        rows = batch[c].shape[0]
        tokens = jnp.concatenate([batch[c], batch[f"kl_{c}"]], axis=0)
        masks = jnp.concatenate([jnp.asarray(batch[f"{c}_mask"], jnp.float32),
                                 jnp.asarray(batch[f"kl_{c}_mask"], jnp.float32)], axis=0)
        logp, _ = sequence_logprob(self.model, policy_variables(variables), tokens, masks)
        ref, _ = sequence_logprob(self.model, reference_variables(variables), tokens, masks)
        ratio = logp - jax.lax.stop_gradient(ref)
        r, kl_ratio = ratio[:rows], ratio[rows:]
        z0 = jax.lax.stop_gradient(jnp.maximum(jnp.mean(kl_ratio), 0.0))
        desirable = jnp.asarray(batch[self.label_key], jnp.float32).reshape(-1)
        value = jnp.where(desirable > 0, self.desirable_weight * jax.nn.sigmoid(self.beta * (r - z0)),
                          self.undesirable_weight * jax.nn.sigmoid(self.beta * (z0 - r)))
        weight = jnp.where(desirable > 0, self.desirable_weight, self.undesirable_weight)
        reward = self.beta * r
        metrics: dict[str, Mean | jax.Array] = {
            "kl": Mean.of(z0),
            "desirable_reward": Mean.of(reward, desirable),
            "undesirable_reward": Mean.of(reward, 1.0 - desirable),
            "label_accuracy": Mean.of(((r > z0) == (desirable > 0)).astype(jnp.float32)),
        }
        return Mean.of(weight - value), Aux(metrics=metrics)
