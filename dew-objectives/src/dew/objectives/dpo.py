"""Direct preference optimization: raise the chosen completion's likelihood over the rejected one's.

A batch holds pairs of token sequences that share a prompt: ``chosen`` and
``rejected`` (int32 [B, L], prompt then completion, right-padded), each with
a mask (``chosen_mask``, ``rejected_mask``: 1 on the completion's tokens) and
``prompt_length`` [B]. The implicit reward of a completion is beta times its
log-likelihood ratio to a reference policy; the losses are

- ``sigmoid`` (DPO): -log sigmoid(beta * (margin_chosen - margin_rejected)), with
  ``label_smoothing`` eps: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (cDPO)
- ``ipo``: (margin_chosen - margin_rejected - 1 / (2 beta))^2
- ``hinge`` (SLiC): max(0, 1 - beta * (margin_chosen - margin_rejected))
- ``robust`` (rDPO): the logistic loss unbiased for labels flipped with probability eps
- ``bco_pair`` (BCO): -log sigmoid(beta margin_chosen - delta) - log sigmoid(-(beta margin_rejected - delta)),
  delta the running mean of every beta * margin seen (kept in the ``bco`` collection)
- ``simpo`` (reference-free): -log sigmoid(beta * (mean logp_chosen - mean logp_rejected) - gamma)

where margin = log pi(completion) - log pi_ref(completion) (``pair_losses.py``
writes each out). The reference
is a frozen copy of the policy's starting weights (``reference="frozen"``),
or log-probabilities a reader computed beforehand (``"precomputed"``, read
from ``chosen_reference_logp`` and ``rejected_reference_logp``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.data.base import Batch as HostBatch
from dew.errors import BatchKeyError, DewError
from dew.nn.kinds import CausalDecoder
from dew.objectives import pair_losses
from dew.objectives.base import Aux, Batch, LeafFilter, Mean, Objective, Step, Variables, under
from dew.objectives.policy import (
    REFERENCE,
    PolicyFrom,
    check_model_reach,
    policy_pipeline,
    policy_variables,
    reference_variables,
    token_logprobs,
    with_reference,
)

if TYPE_CHECKING:
    from dew.sampling import Sampling, TextGeneration
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["DPOObjective", "MismatchedPairError", "PairCheck", "sequence_logprob"]

BCO = "bco"  # the collection holding bco_pair's running mean of rewards and how many it has seen


class MismatchedPairError(DewError, ValueError):
    """A chosen and a rejected sequence of one pair do not share their prompt."""


def sequence_logprob(model: nn.Module, variables: Variables, tokens: jax.Array,
                     mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The summed log-probability of the masked tokens of each row, and how many there are."""
    logp, _ = token_logprobs(model, variables, tokens)
    weights = jnp.asarray(mask, jnp.float32)[:, 1:]
    return jnp.sum(logp * weights, axis=-1), jnp.sum(weights, axis=-1)


@dataclass(frozen=True)
class PairCheck:
    """A rollout that only checks each batch on the host: every pair shares its prompt.

    It returns the batch unchanged, so the step compiles once; a pair whose
    chosen and rejected prompts differ is refused, naming its row.
    """

    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    prompt_length_key: str = "prompt_length"

    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> HostBatch:
        check_pairs(batch, self.chosen_key, self.rejected_key, self.prompt_length_key)
        return batch


def check_pairs(batch: HostBatch, chosen_key: str = "chosen", rejected_key: str = "rejected",
                prompt_length_key: str = "prompt_length") -> None:
    """Refuse a batch in which some pair's chosen and rejected sequences start with different prompts.

    >>> import numpy as np
    >>> check_pairs({"chosen": np.array([[1, 2, 3]]), "rejected": np.array([[1, 5, 3]]),
    ...              "prompt_length": np.array([2])})
    Traceback (most recent call last):
    ...
    dew.objectives.dpo.MismatchedPairError: Pair 0 of the batch has different prompts: ...
    """
    missing = [k for k in (chosen_key, rejected_key, prompt_length_key) if k not in batch]
    if missing:
        raise BatchKeyError(
            f"Preference pairs are read under {chosen_key!r} and {rejected_key!r} (token ids, one row "
            f"per pair) with the shared prompt's length under {prompt_length_key!r}, but the batch "
            f"holds {sorted(batch)}, without {', '.join(map(repr, missing))}. Give the objective pair "
            "data (the addition reader's form 'pairs', or a preference dataset), or set chosen_key, "
            "rejected_key and prompt_length_key to the keys that hold them."
        )
    chosen, rejected = np.asarray(batch[chosen_key]), np.asarray(batch[rejected_key])
    lengths = np.asarray(batch[prompt_length_key]).reshape(-1)
    if chosen.shape[0] != rejected.shape[0] or chosen.shape[0] != lengths.shape[0]:
        raise MismatchedPairError(
            f"The batch holds {chosen.shape[0]} {chosen_key!r}, {rejected.shape[0]} {rejected_key!r} "
            f"and {lengths.shape[0]} {prompt_length_key!r} rows; a pair is one row of each."
        )
    for i, n in enumerate(lengths):
        n = int(n)
        if not np.array_equal(chosen[i, :n], rejected[i, :n]):
            raise MismatchedPairError(
                f"Pair {i} of the batch has different prompts: {chosen_key} starts "
                f"{chosen[i, :n].tolist()} and {rejected_key} {rejected[i, :n].tolist()} over its "
                f"{n} prompt tokens. Both completions of a pair must follow the same prompt; "
                "fix the record in the data."
            )


_SIMPO_GAMMA = 0.5  # DPOObjective.gamma's default, which only loss_type='simpo' reads


@dataclass(frozen=True)
class DPOObjective(Objective):
    """Preference pairs scored against a frozen reference (see the module docstring).

    metrics: ``reward_margin`` (beta times the difference of the chosen's and
    the rejected's log-ratio to the reference), ``preference_accuracy`` (the
    share of pairs whose margin is positive), ``chosen_logp`` and
    ``rejected_logp`` (summed over each completion). A recipe's ``init``
    section (a language-model run, say) gives the parameters the policy and
    the reference start from when the run is fresh. Validation scores
    held-out pairs with the same loss and metrics. tokenizer (a recipe's
    reader supplies it) and stop_token make the trained policy text
    generation (``pipeline``).
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo", "simpo", "hinge", "robust", "bco_pair"] = "sigmoid"
    gamma: float = _SIMPO_GAMMA
    label_smoothing: float = 0.0
    reference: Literal["frozen", "precomputed"] = "frozen"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    prompt_length_key: str = "prompt_length"
    stop_token: int | None = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        check_model_reach("DPOObjective", self.model, seq_len=self.seq_len, stop_token=self.stop_token)
        if not 0 < self.beta < math.inf:  # NaN too
            raise ValueError(f"DPOObjective.beta must be a positive finite number, got {self.beta}.")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DPOObjective.label_smoothing is the probability that a pair's labels are "
                             f"flipped, in [0, 0.5); got {self.label_smoothing}.")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise ValueError(f"DPOObjective.label_smoothing applies to loss_type 'sigmoid' or 'robust', "
                             f"not {self.loss_type!r}; set it to 0 or change loss_type.")
        if self.gamma != _SIMPO_GAMMA and self.loss_type != "simpo":
            raise ValueError(f"DPOObjective.gamma is SimPO's target margin, read by loss_type 'simpo' alone, "
                             f"not {self.loss_type!r}; drop it or set loss_type='simpo'.")
        if self.loss_type == "simpo" and self.reference != "frozen":
            raise ValueError("DPOObjective.reference='precomputed' reads reference log-probabilities, which "
                             "SimPO does without (its margin is the policy's own length-normalized one); "
                             "drop reference or choose another loss_type.")

    @property
    def holds_reference(self) -> bool:
        return self.loss_type != "simpo" and self.reference == "frozen"

    @property
    def reference_collection(self) -> str | None:
        """The collection holding the frozen copy of the starting policy (None: no copy is kept).

        ``adapters_only`` reads it to keep no copy: with LoRA the reference is the base model.
        """
        return REFERENCE if self.holds_reference else None

    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]
        return under(REFERENCE) if self.holds_reference else None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The policy's variables (given ones pass through) and, with a frozen reference, its copy."""
        if variables is None:
            variables = self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))
        variables = with_reference(variables) if self.holds_reference else policy_variables(variables)
        if self.loss_type == "bco_pair" and BCO not in variables:
            variables = {**variables, BCO: {"mean": jnp.zeros((), jnp.float32),
                                            "count": jnp.zeros((), jnp.float32)}}
        return variables

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the policy's parameters (the reference copies them)."""
        return PolicyFrom(source)

    def pipeline(self, state: TrainState | Variables, *, sampling: Sampling | Mapping[str, Any] | None = None) -> TextGeneration:
        """The policy (without its reference) as text generation, stopping at stop_token."""
        return policy_pipeline(self.model, state, self.tokenizer, sampling=sampling,
                               stop_token=self.stop_token)

    def rollout(self) -> PairCheck:
        """The host-side check a recipe runs before each step: pairs share their prompt."""
        return PairCheck(self.chosen_key, self.rejected_key, self.prompt_length_key)

    def required_keys(self) -> Sequence[str]:
        keys = [self.chosen_key, self.rejected_key, f"{self.chosen_key}_mask", f"{self.rejected_key}_mask"]
        if self.loss_type != "simpo" and self.reference == "precomputed":
            keys += [f"{self.chosen_key}_reference_logp", f"{self.rejected_key}_reference_logp"]
        return tuple(keys)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        policy = {k: v for k, v in policy_variables(variables).items() if k != BCO}
        updates = None
        chosen, rejected = batch[self.chosen_key], batch[self.rejected_key]
        chosen_mask, rejected_mask = batch[f"{self.chosen_key}_mask"], batch[f"{self.rejected_key}_mask"]
        # One forward pass over both halves of every pair.
        tokens = jnp.concatenate([chosen, rejected], axis=0)
        masks = jnp.concatenate([chosen_mask, rejected_mask], axis=0)
        logp, counts = sequence_logprob(self.model, policy, tokens, masks)
        pairs = chosen.shape[0]
        logp_c, logp_r = logp[:pairs], logp[pairs:]
        if self.loss_type == "simpo":
            logits = self.beta * (logp_c / jnp.maximum(counts[:pairs], 1.0)
                                  - logp_r / jnp.maximum(counts[pairs:], 1.0)) - self.gamma
            losses = -jax.nn.log_sigmoid(logits)
            margin = logits + self.gamma  # the rewards' margin: gamma is the loss's target, not a reward
        else:
            if self.reference == "precomputed":
                ref_c = jnp.asarray(batch[f"{self.chosen_key}_reference_logp"], jnp.float32)
                ref_r = jnp.asarray(batch[f"{self.rejected_key}_reference_logp"], jnp.float32)
            else:
                ref, _ = sequence_logprob(self.model, reference_variables(variables), tokens, masks)
                ref = jax.lax.stop_gradient(ref)
                ref_c, ref_r = ref[:pairs], ref[pairs:]
            difference = (logp_c - ref_c) - (logp_r - ref_r)
            margin = self.beta * difference
            if self.loss_type == "ipo":
                losses = pair_losses.ipo(difference, self.beta)
            elif self.loss_type == "hinge":
                losses = pair_losses.hinge(difference, self.beta)
            elif self.loss_type == "robust":
                losses = pair_losses.robust(difference, self.beta, self.label_smoothing)
            elif self.loss_type == "bco_pair":
                rewards = jax.lax.stop_gradient(self.beta * jnp.concatenate([logp_c - ref_c, logp_r - ref_r]))
                mean, count = pair_losses.running_mean(variables[BCO]["mean"], variables[BCO]["count"], rewards)
                losses = pair_losses.bco_pair(logp_c - ref_c, logp_r - ref_r, self.beta, mean)
                updates = {BCO: {"mean": mean, "count": count}}
            else:
                losses = pair_losses.sigmoid(difference, self.beta, self.label_smoothing)
        metrics = {
            "reward_margin": Mean.of(margin),
            "preference_accuracy": Mean.of((margin > 0).astype(jnp.float32)),
            "chosen_logp": Mean.of(logp_c),
            "rejected_logp": Mean.of(logp_r),
        }
        if updates is not None:
            metrics["reward_shift"] = Mean.of(updates[BCO]["mean"])
        return Mean.of(losses), Aux(metrics=metrics, updates=updates)
