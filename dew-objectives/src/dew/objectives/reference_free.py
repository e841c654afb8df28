"""Preference pairs without a reference model: ORPO and CPO.

Both read DPO's pairs (``chosen``, ``rejected``, their masks over the
completion, ``prompt_length``) and keep no frozen copy of the policy, so
their variables are exactly a language model's. Each adds a likelihood term
on the chosen completion to a contrast between the two (``pair_losses.py``):

- ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
  Reference Model"): NLL(y_w) - beta * log sigmoid(log odds(y_w) - log odds(y_l)),
  the odds of a completion P / (1 - P) with P its mean token probability;
- CPO (Xu et al. 2024, "Contrastive Preference Optimization"):
  -log sigmoid(beta * (log pi(y_w) - log pi(y_l))) + alpha * NLL(y_w).

NLL(y_w) is the chosen completion's mean negative log-probability per token.
Once trained, the policy is text generation (``pipeline``), as a DPO policy is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.kinds import CausalDecoder
from dew.objectives import pair_losses
from dew.objectives.base import Aux, Batch, Mean, Objective, Step, Variables
from dew.objectives.dpo import PairCheck, sequence_logprob
from dew.objectives.policy import PolicyFrom, check_model_reach, policy_pipeline, policy_variables

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dew.sampling import Sampling, TextGeneration
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["CPOObjective", "ORPOObjective"]


@dataclass(frozen=True)
class _Pairs(Objective):
    """What ORPO and CPO share: a policy alone, scored on both halves of each pair in one pass.

    tokenizer (a recipe's reader supplies it) and stop_token make the trained
    policy text generation (``pipeline``).
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    beta: float = 0.1
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    prompt_length_key: str = "prompt_length"
    stop_token: int | None = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        check_model_reach(type(self).__name__, self.model, seq_len=self.seq_len, stop_token=self.stop_token)
        if not 0 < self.beta < math.inf:  # NaN too
            raise ValueError(f"{type(self).__name__}.beta must be a positive finite number, got {self.beta}.")

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The policy's variables (given ones pass through): there is no reference to copy."""
        if variables is None:
            variables = self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))
        return policy_variables(variables)

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the model's parameters."""
        return PolicyFrom(source)

    def pipeline(self, state: TrainState | Variables, *, sampling: Sampling | Mapping[str, Any] | None = None) -> TextGeneration:
        """The policy as text generation, stopping at stop_token."""
        return policy_pipeline(self.model, state, self.tokenizer, sampling=sampling,
                               stop_token=self.stop_token)

    def rollout(self) -> PairCheck:
        """The host-side check a recipe runs before each step: pairs share their prompt."""
        return PairCheck(self.chosen_key, self.rejected_key, self.prompt_length_key)

    def required_keys(self) -> Sequence[str]:
        return (self.chosen_key, self.rejected_key, f"{self.chosen_key}_mask", f"{self.rejected_key}_mask")

    def _logps(self, variables: Variables, batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Summed and mean per-token log-probabilities of the chosen and the rejected completions."""
        chosen, rejected = batch[self.chosen_key], batch[self.rejected_key]
        tokens = jnp.concatenate([chosen, rejected], axis=0)
        masks = jnp.concatenate([batch[f"{self.chosen_key}_mask"], batch[f"{self.rejected_key}_mask"]], axis=0)
        total, count = sequence_logprob(self.model, policy_variables(variables), tokens, masks)
        mean = total / jnp.maximum(count, 1.0)
        pairs = chosen.shape[0]
        return total[:pairs], total[pairs:], mean[:pairs], mean[pairs:]


@dataclass(frozen=True)
class ORPOObjective(_Pairs):
    """ORPO: the chosen's NLL plus beta (lambda in the paper) times the odds-ratio loss.

    metrics: ``log_odds_ratio`` (log odds of the chosen less the rejected's),
    ``preference_accuracy`` (pairs whose log-odds ratio is positive), ``nll``
    (the chosen's mean per token), ``chosen_logp`` and ``rejected_logp``
    (mean per token).
    """

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        _, _, mean_c, mean_r = self._logps(variables, batch)
        losses, ratio = pair_losses.orpo(mean_c, mean_r, self.beta)
        metrics: dict[str, Mean | jax.Array] = {
            "log_odds_ratio": Mean.of(ratio),
            "preference_accuracy": Mean.of((ratio > 0).astype(jnp.float32)),
            "nll": Mean.of(-mean_c),
            "chosen_logp": Mean.of(mean_c),
            "rejected_logp": Mean.of(mean_r),
        }
        return Mean.of(losses), Aux(metrics=metrics)


@dataclass(frozen=True)
class CPOObjective(_Pairs):
    """CPO: the reference-free logistic preference loss plus alpha times the chosen's NLL.

    metrics: ``reward_margin`` (beta times the summed log-probability of the
    chosen less the rejected's), ``preference_accuracy`` (pairs whose margin
    is positive), ``nll``, ``chosen_logp`` and ``rejected_logp`` (summed).
    """

    _: KW_ONLY
    alpha: float = 1.0

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        logp_c, logp_r, mean_c, _ = self._logps(variables, batch)
        losses = pair_losses.cpo(logp_c, logp_r, mean_c, self.beta, self.alpha)
        margin = self.beta * (logp_c - logp_r)
        metrics: dict[str, Mean | jax.Array] = {
            "reward_margin": Mean.of(margin),
            "preference_accuracy": Mean.of((margin > 0).astype(jnp.float32)),
            "nll": Mean.of(-mean_c),
            "chosen_logp": Mean.of(logp_c),
            "rejected_logp": Mean.of(logp_r),
        }
        return Mean.of(losses), Aux(metrics=metrics)
