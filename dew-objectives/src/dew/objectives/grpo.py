"""Group relative policy optimization: completions of one prompt compete for their reward.

Each step's batch comes from a ``CompletionRollout`` (``GRPOObjective.rollout()``):
``group_size`` completions sampled per prompt with the live policy, their
rewards, and their tokens' log-probabilities under the policy that sampled
them. Rows are grouped in consecutive runs of ``group_size``; each row's
advantage is its reward less its group's mean, divided by the group's
standard deviation (``scale_rewards``). The loss per completion token is

    -(min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) - beta * k3)

with ratio = pi / pi_old and k3 = exp(ref - logp) - (ref - logp) - 1, the
KL estimator against a frozen reference (a copy of the starting policy). It
is averaged over all completion tokens of the batch (``normalize="token"``),
over each completion then over completions (``"sequence"``), or summed over
each completion's tokens under a constant length (``"constant"``).

The same objective carries the variants of the GRPO family (``grpo_family.py``
registers each paper's settings under its own name): the leave-one-out
baseline (``baseline``, RLOO), sequence-level ratios (``ratio``, GSPO),
CISPO's clipped importance weights (``policy_loss``), DAPO's asymmetric
clipping, dynamic sampling and overlong shaping (``clip_low``/``clip_high``,
``dynamic_sampling``, ``overlong``), and Dr.GRPO's unscaled advantages under a
constant length (``scale_rewards=False``, ``normalize="constant"``). The
formulas are in ``group_losses.py``; the host-side filters in ``group_sampling.py``.

Rollouts are asynchronous by default (``max_lag=1``): the completions of
step n+1 are sampled, from the policy of step n, while step n trains, so a
step trains on completions of the policy at most ``max_lag`` steps behind
it. pi_old in the ratio is that sampling policy (``old_logp`` is scored with
the parameters that sampled), so the clipped ratio corrects for the lag as
it corrects for several updates on one sample. ``max_lag=0`` samples each
step from the policy it trains, when it asks (on-policy). The lag is a field
of the objective, beside the clip range it interacts with, rather than of
the trainer: it changes what the loss estimates, and a recipe that sets it
sets it with the objective it changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.data.base import ending_ids
from dew.nn.kinds import CausalDecoder
from dew.objectives import group_losses
from dew.objectives.base import (
    Aux,
    Batch,
    LeafFilter,
    Mean,
    Objective,
    Step,
    Variables,
    under,
)
from dew.objectives.episodes import EpisodeRollout, check_turn_timeout
from dew.objectives.group_losses import (
    Aggregation,
    Baseline,
    GroupSizeError,
    PolicyLoss,
    RatioLevel,
    clipped_policy_loss,
    group_advantages,
)
from dew.objectives.group_sampling import GroupFilter, IncompatibleOptionsError, OverlongShaping
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
from dew.objectives.rollouts import CompletionRollout, GreedyRewardValidation
from dew.rewards import resolve
from dew.sampling import Sampling, TextGeneration

if TYPE_CHECKING:
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["GRPOObjective", "GroupSizeError", "IncompatibleOptionsError", "clipped_policy_loss",
           "group_advantages"]

# What the host-side filters add to a batch, logged as metrics of the same name.
_ROLLOUT_STATISTICS = ("sampled_reward", "dropped_groups", "filler_groups", "sampling_rounds", "truncated",
                       "turns", "failed_episodes")


# GRPOObjective's defaults of the options _refuse_unread checks are read where set.
_DEFAULT_CLIP, _DEFAULT_ROUNDS, _DEFAULT_BUFFER, _DEFAULT_PENALTY = 0.2, 4, 2, 1.0
_DEFAULT_LAG = 1


@dataclass(frozen=True)
class GRPOObjective(GreedyRewardValidation, Objective):
    """GRPO over completions a rollout samples (see the module docstring).

    reward is a registered reward's name, ``{"name": ..., **fields}``, or a
    callable. metrics: ``reward`` (its mean over the batch), ``kl`` (k3, per
    token), ``clip_fraction`` (tokens whose ratio left the clip range) and
    ``entropy`` (of the policy's next-token distribution, per token); with
    dynamic sampling or overlong shaping also ``sampled_reward`` (the raw
    reward's mean over every completion sampled for the step),
    ``dropped_groups``, ``filler_groups``, ``sampling_rounds`` and ``truncated``.

    clip_low and clip_high bound the ratio to [1 - clip_low, 1 + clip_high]
    (each defaults to clip). length_normalizer is the constant length of
    ``normalize="constant"`` (default max_new_tokens). Dynamic sampling
    drops groups whose rewards are all equal and refills the batch from the
    stream, over at most max_sampling_rounds samplings; overlong shaping adds
    ``-overlong_penalty * ramp`` to the reward of completions within
    overlong_buffer tokens of max_new_tokens (``"penalty"``) or removes
    truncated completions from the loss (``"mask"``).

    environment (a registered environment's name, ``{"name": ..., **fields}``
    or an instance; ``dew.environments``) makes each completion a multi-turn
    episode (``EpisodeRollout``): the model's turns of max_new_tokens each, the
    environment's answers between them (outside the loss), and the
    environment's reward at the end instead of reward's; turn_timeout bounds
    the calls into it that one engine step asks for (then also ``turns`` and
    ``failed_episodes`` are logged). Episodes are played on-policy: max_lag paces completions alone.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder

    model: nn.Module
    reward: Any = "exact_match"
    _: KW_ONLY
    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    clip: float = _DEFAULT_CLIP
    clip_low: float | None = None
    clip_high: float | None = None
    beta: float = 0.04
    scale_rewards: bool = True
    baseline: Baseline = "mean"
    ratio: RatioLevel = "token"
    policy_loss: PolicyLoss = "clip"
    normalize: Aggregation = "token"
    length_normalizer: float | None = None
    dynamic_sampling: bool = False
    max_sampling_rounds: int = _DEFAULT_ROUNDS
    overlong: Literal["none", "penalty", "mask"] = "none"
    overlong_buffer: int = _DEFAULT_BUFFER
    overlong_penalty: float = _DEFAULT_PENALTY
    max_lag: int = _DEFAULT_LAG
    stop_token: int | None = None
    prompt_key: str = "prompt"
    prompt_length_key: str = "prompt_length"
    tokenizer: Any = None
    environment: Any = None
    turn_timeout: float | None = 10.0

    def __post_init__(self) -> None:
        self.check_reward()
        name = type(self).__name__
        if self.dynamic_sampling and self.group_size < 2:
            raise IncompatibleOptionsError(
                f"{name}.dynamic_sampling=True needs group_size >= 2, got group_size={self.group_size}: "
                "it drops groups whose rewards are all equal, and a group of one always is. Raise "
                "group_size or set dynamic_sampling=False."
            )
        if self.group_size < 2:
            raise ValueError(f"{name}.group_size must be at least 2 (a group compares "
                             f"completions), got {self.group_size}.")
        if not self.temperature > 0:
            raise ValueError(
                f"{name}.temperature must be above 0, got {self.temperature}: greedy decoding gives every "
                "completion of a group the same text, so every advantage is 0 and nothing trains.")
        if not self.beta >= 0:
            raise ValueError(f"{name}.beta, the KL penalty's weight, must be at least 0 (0: no penalty), got "
                             f"{self.beta}.")
        check_model_reach(name, self.model, stop_token=self.stop_token, max_new_tokens=self.max_new_tokens)
        if self.policy_loss == "cispo" and self.ratio != "token":
            raise IncompatibleOptionsError(
                f"{name}.policy_loss='cispo' clips each token's importance weight, but ratio="
                f"{self.ratio!r} takes one ratio per sequence (GSPO): token-level clipping of a "
                "sequence-level ratio is not defined. Use ratio='token' with CISPO, or "
                "policy_loss='clip' with GSPO."
            )
        for field in ("clip", "clip_low", "clip_high"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise ValueError(f"{name}.{field} must be >= 0, got {value}.")
        if self.length_normalizer is not None and self.length_normalizer <= 0:
            raise ValueError(f"{name}.length_normalizer must be positive, got {self.length_normalizer}.")
        if isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int) or self.max_lag < 0:
            raise ValueError(f"{name}.max_lag must be a whole number of steps >= 0, got {self.max_lag!r}: "
                             "0 samples each step from the policy it trains, 1 while the step before trains.")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"{name}.max_sampling_rounds must be at least 1, got {self.max_sampling_rounds}.")
        self._refuse_unread(name)
        if self.overlong != "none":
            if not ending_ids(self.stop_token, self.tokenizer):
                raise IncompatibleOptionsError(
                    f"{name}.overlong={self.overlong!r} needs stop_token (or a tokenizer with an end token): "
                    "without one every completion runs to max_new_tokens and counts as truncated. Set "
                    "stop_token or overlong='none'."
                )
            if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_new_tokens:
                raise ValueError(
                    f"{name}.overlong_buffer must lie in [1, max_new_tokens={self.max_new_tokens}], got "
                    f"{self.overlong_buffer}: the penalty ramps over the last overlong_buffer tokens."
                )

    def _refuse_unread(self, name: str) -> None:
        """Options set away from their default where nothing reads them: each trained as if absent."""
        unread = []
        if self.clip != _DEFAULT_CLIP and self.clip_low is not None and self.clip_high is not None:
            unread.append(f"clip={self.clip} (clip_low={self.clip_low} and clip_high={self.clip_high} bound the "
                          "ratio; set those)")
        if self.length_normalizer is not None and self.normalize != "constant":
            unread.append(f"length_normalizer={self.length_normalizer} (it divides normalize='constant' "
                          f"alone; normalize={self.normalize!r})")
        if self.environment is not None and self.max_lag > _DEFAULT_LAG:
            unread.append(f"max_lag={self.max_lag} (an environment's episodes are played with the policy that "
                          "trains on them)")
        if self.max_sampling_rounds != _DEFAULT_ROUNDS and not self.dynamic_sampling:
            unread.append(f"max_sampling_rounds={self.max_sampling_rounds} (it bounds dynamic_sampling, which "
                          "is off)")
        if self.overlong != "penalty" and (self.overlong_penalty != _DEFAULT_PENALTY
                                           or self.overlong_buffer != _DEFAULT_BUFFER):
            unread.append(f"overlong_penalty and overlong_buffer (they shape overlong='penalty'; "
                          f"overlong={self.overlong!r})")
        if unread:
            raise IncompatibleOptionsError(f"{name} would train as without " + "; ".join(unread)
                                           + ": drop them, or set what reads them.")
        if self.overlong_penalty < 0:
            raise ValueError(f"{name}.overlong_penalty must be at least 0, got {self.overlong_penalty}: below 0 "
                             "it pays completions for running long.")
        if self.overlong != "none" and self.environment is not None:
            raise IncompatibleOptionsError(
                f"{name}.overlong={self.overlong!r} measures a completion against max_new_tokens, which an "
                "environment's episode spends per turn: every turn within budget could still read as "
                "overlong. Set overlong='none' with an environment.")
        if self.environment is not None:  # checked as the recipe is, not when the rollout is first built
            from dew.environments import resolve_environment

            resolve_environment(self.environment)
            check_turn_timeout(self.turn_timeout, f"{name}.turn_timeout")

    @property
    def bounds(self) -> tuple[float, float]:
        """(clip_low, clip_high), each defaulting to clip."""
        low = self.clip if self.clip_low is None else self.clip_low
        high = self.clip if self.clip_high is None else self.clip_high
        return low, high

    @property
    def reference_collection(self) -> str | None:
        """The collection holding the frozen copy of the starting policy (None: no copy is kept).

        ``adapters_only`` reads it to keep no copy: with LoRA the reference is the base model.
        """
        return REFERENCE if self.beta > 0 else None

    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]
        return under(REFERENCE) if self.beta > 0 else None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The policy's variables (given ones pass through) and, when beta > 0, the reference's copy."""
        if variables is None:
            variables = self.model.init(key, jnp.zeros((1, 1), jnp.int32))
        return with_reference(variables) if self.beta > 0 else policy_variables(variables)

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the policy's parameters (the reference copies them)."""
        return PolicyFrom(source)

    def rollout(self) -> CompletionRollout | EpisodeRollout | GroupFilter:
        """The rollout that samples and scores this objective's completions (filtered, when asked)."""
        sampler: CompletionRollout | EpisodeRollout
        if self.environment is not None:
            sampler = EpisodeRollout(
                self.model, self.environment, group_size=self.group_size,
                max_new_tokens=self.max_new_tokens, sampling=Sampling(temperature=self.temperature),
                tokenizer=self.tokenizer, stop_token=self.stop_token, prompt_key=self.prompt_key,
                prompt_length_key=self.prompt_length_key, turn_timeout=self.turn_timeout)
        else:
            sampler = CompletionRollout(
                self.model, resolve(self.reward), group_size=self.group_size,
                max_new_tokens=self.max_new_tokens, sampling=Sampling(temperature=self.temperature),
                tokenizer=self.tokenizer, stop_token=self.stop_token, prompt_key=self.prompt_key,
                prompt_length_key=self.prompt_length_key, max_lag=self.max_lag,
            )
        if not self.dynamic_sampling and self.overlong == "none":
            return sampler
        shaping = None if self.overlong == "none" else OverlongShaping(
            self.overlong, max_new_tokens=self.max_new_tokens, buffer=self.overlong_buffer,
            penalty=self.overlong_penalty, stops=ending_ids(self.stop_token, self.tokenizer))
        return GroupFilter(sampler, group_size=self.group_size, dynamic=self.dynamic_sampling,
                           max_rounds=self.max_sampling_rounds, shaping=shaping,
                           max_lag=0 if self.environment is not None else self.max_lag)  # episodes: on-policy

    def required_keys(self) -> Sequence[str]:
        return ("tokens", "mask", "reward", "old_logp")

    def pipeline(self, state: TrainState | Variables, *, sampling: Sampling | Mapping[str, Any] | None = None
                 ) -> TextGeneration:
        """The policy as text generation (greedy unless sampling says otherwise), stopping at stop_token."""
        return policy_pipeline(self.model, state, self.tokenizer, sampling=sampling,
                               stop_token=self.stop_token)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        tokens, reward = batch["tokens"], jnp.asarray(batch["reward"], jnp.float32)
        mask = jnp.asarray(batch["mask"], jnp.float32)[:, 1:]
        advantage = group_advantages(reward, self.group_size, scale=self.scale_rewards, baseline=self.baseline)
        # At the sampling temperature, as old_logp was scored: the ratio is to the policy that sampled.
        logp, entropy = token_logprobs(self.model, policy_variables(variables), tokens, self.temperature)
        low, high = self.bounds
        per_token, clipped = group_losses.policy_loss(
            logp, batch["old_logp"], advantage, mask, clip_low=low, clip_high=high, level=self.ratio,
            loss=self.policy_loss)
        metrics: dict[str, Mean | jax.Array] = {
            "reward": Mean.of(reward),
            "clip_fraction": Mean(jnp.sum(clipped * mask), jnp.sum(mask)),
            "entropy": Mean(jnp.sum(entropy * mask), jnp.sum(mask)),
        }
        for name in _ROLLOUT_STATISTICS:
            if name in batch:
                metrics[name] = Mean.of(batch[name])
        if self.beta > 0:
            ref_logp, _ = token_logprobs(self.model, reference_variables(variables), tokens, self.temperature)
            delta = jax.lax.stop_gradient(ref_logp) - logp
            k3 = jnp.exp(delta) - delta - 1.0
            per_token = per_token + self.beta * k3
            metrics["kl"] = Mean(jnp.sum(k3 * mask), jnp.sum(mask))
        length = float(self.length_normalizer or self.max_new_tokens)
        return group_losses.aggregate(per_token, mask, self.normalize, length), Aux(metrics=metrics)
