"""Rollouts that sample completions from the live policy and score them with a reward.

``CompletionRollout`` runs on the host before each step: it asks the
generation engine (``dew.sampling.Engine``) for ``group_size`` completions of
each prompt of the batch with the current parameters (the prompt is written
once and its samples share it; a completion ends at the stop token and frees
its place for the next; the compiled programs read the parameters on the
devices and only the sampled ids come back to the host), decodes each
completion, scores it with the reward, and scores every token of the
sequences under the sampling policy (``old_logp``, for the clipped ratio).
What it returns has the same shapes at every step:

- ``tokens`` int32 [P*G, Lp+N]: each prompt followed directly by its completion
- ``mask`` float32 [P*G, Lp+N]: 1 on the completion's tokens up to and with the stop token
- ``reward`` float32 [P*G], ``old_logp`` float32 [P*G, Lp+N-1]

The reward's context holds the batch's other keys, one value per
completion, and ``prompt_text``: each completion's prompt as text (what a
reward model scores with the completion).

The time spent in the reward is kept apart (``reward_seconds``), so the
goodput split shows it as its own row. What each call scored (prompts,
completions, rewards and their context, as text and numbers) is kept until
``transcript()`` takes it: the rollout journal writes it with the step.

Validation asks the same question without sampling noise: ``greedy_outputs``
continues a validation batch's prompts greedily inside the compiled scorer,
and ``RewardMetric`` cuts each completion at the stop token, decodes it and
scores it with the reward on the host, as the rollout does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.data.base import Batch as HostBatch
from dew.data.base import Tokenizer, ending_ids, verbatim_text
from dew.data.tokenizers import drawable_vocab
from dew.errors import BatchKeyError
from dew.objectives.base import Batch, Metric, Step, Variables
from dew.objectives.policy import policy_variables, token_logprobs
from dew.rewards import Reward, resolve, score
from dew.sampling import Engine, EngineConfig, Request, Sampling
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.training.state import TrainState

__all__ = ["CompletionRollout", "GreedyRewardValidation", "PolicyRollout", "RewardMetric", "RolloutBatchError",
           "completion_text", "greedy_continuation", "greedy_outputs", "prompt_text"]


# The batch a rollout receives lacks the prompts or their lengths: dew's one batch-key error.
RolloutBatchError = BatchKeyError


def _decode(tokenizer: Tokenizer | None, ids: Sequence[int]) -> str:
    if tokenizer is None:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
    return tokenizer.decode(list(ids))


def prompt_text(tokenizer: Tokenizer | None, ids: Sequence[int]) -> str:
    """A prompt as the policy saw it: a chat template's markers kept, so a reward model reads the
    ids its pairs were encoded to (and the journal shows the turns)."""
    return _decode(None, ids) if tokenizer is None else verbatim_text(tokenizer, list(ids))


def completion_text(tokenizer: Tokenizer | None, completion: Sequence[int],
                    stops: Sequence[int] = ()) -> tuple[str, int]:
    """A completion's text up to its first stop id, and how many of its tokens count (the stop included)."""
    row = np.asarray(completion).reshape(-1)
    kept, shown = len(row), row
    ends = np.flatnonzero(np.isin(row, list(stops)))
    if ends.size:
        kept, shown = int(ends[0]) + 1, row[: int(ends[0])]
    return _decode(tokenizer, [int(t) for t in shown if t >= 0]), kept


def greedy_continuation(model: nn.Module, variables: Variables, prompts: jax.Array, lengths: jax.Array,
                        max_new_tokens: int) -> jax.Array:
    """The likeliest max_new_tokens after each right-padded prompt, [B, N], traceable.

    Each new token runs the model over the whole padded row (no cache): the
    causal mask keeps a position from seeing the padding after it, and a
    validation batch is small, so the simplicity is worth the recompute.

    >>> import flax.linen as nn
    >>> class Next(nn.Module):  # always predicts the token after the current one
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return jax.nn.one_hot((x + 1) % 8, 8)
    >>> greedy_continuation(Next(), {}, jnp.array([[3, 0], [5, 6]]), jnp.array([1, 2]), 3).tolist()
    [[4, 5, 6], [7, 0, 1]]
    """
    rows, width = prompts.shape
    index = jnp.arange(rows)
    tokens = jnp.concatenate([prompts, jnp.zeros((rows, max_new_tokens), prompts.dtype)], axis=1)

    def next_token(i: jax.Array, tokens: jax.Array) -> jax.Array:
        logits = model.apply(variables, tokens)
        chosen = jnp.argmax(logits[index, lengths + i - 1], axis=-1).astype(tokens.dtype)
        return tokens.at[index, lengths + i].set(chosen)

    tokens = jax.lax.fori_loop(0, max_new_tokens, next_token, tokens)
    return tokens[index[:, None], lengths[:, None] + jnp.arange(max_new_tokens)[None, :]]


def greedy_outputs(model: nn.Module, variables: Variables, batch: Batch, key: jax.Array,
                   max_new_tokens: int, prompt_key: str = "prompt",
                   prompt_length_key: str = "prompt_length") -> dict[str, jax.Array]:
    """A validation batch's prompts continued greedily (traceable): ``completion`` [B, N], the
    prompts and their lengths (under ``PROMPT`` and ``PROMPT_LENGTH``, for ``RewardMetric``'s
    ``prompt_text``) and the batch's other keys, which a reward reads as each completion's context."""
    for name in (prompt_key, prompt_length_key):
        if name not in batch:
            raise RolloutBatchError(
                f"Validation reads prompts under {prompt_key!r} and their lengths under "
                f"{prompt_length_key!r}, but the batch holds {sorted(batch)}.")
    params = {"params": variables["params"]}
    lengths = jnp.reshape(jnp.asarray(batch[prompt_length_key], jnp.int32), (-1,))
    new = greedy_continuation(model, params, jnp.asarray(batch[prompt_key], jnp.int32), lengths,
                              max_new_tokens)
    context = {k: v for k, v in batch.items() if k not in (prompt_key, prompt_length_key)}
    return {"completion": new, PROMPT: jnp.asarray(batch[prompt_key], jnp.int32), PROMPT_LENGTH: lengths,
            **context}


# How many calls' transcripts a rollout holds for a journal that has not asked for them.
_KEPT_ROUNDS = 64

# Where greedy_outputs keeps the prompts a RewardMetric decodes into each completion's prompt_text.
PROMPT, PROMPT_LENGTH = "validation_prompt", "validation_prompt_length"


class RewardMetric:
    """The mean reward of the completions an evaluation wrote (``greedy_outputs``), on the host.

    Each completion is cut at its first stop id (``dew.data.base.ending_ids``:
    stop_token, else the tokenizer's end ids) and decoded with tokenizer (bytes when
    None), then scored with the reward against the batch's other outputs, as
    ``CompletionRollout`` scores what it samples.
    """

    def __init__(self, reward: Reward, *, tokenizer: Tokenizer | None = None, stop_token: int | None = None,
                 name: str = "reward", output: str = "completion") -> None:
        self.reward = reward
        self.tokenizer = tokenizer
        self.stops = ending_ids(stop_token, tokenizer)
        self.name = name
        self.output = output

    def empty(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def completions(self, outputs: Mapping[str, np.ndarray]) -> list[str]:
        """What the reward scores: each completion's text."""
        return [completion_text(self.tokenizer, row, self.stops)[0] for row in np.asarray(outputs[self.output])]

    def update(self, accumulator: tuple[float, float], outputs: Mapping[str, np.ndarray]) -> tuple[float, float]:
        completions = self.completions(outputs)
        context: dict[str, Any] = {k: np.asarray(v) for k, v in outputs.items()
                                   if k not in (self.output, PROMPT, PROMPT_LENGTH)}
        if PROMPT in outputs:  # each completion's prompt as text, as CompletionRollout gives it
            prompts, lengths = np.asarray(outputs[PROMPT]), np.asarray(outputs[PROMPT_LENGTH]).reshape(-1)
            context["prompt_text"] = [prompt_text(self.tokenizer, prompts[i, :int(lengths[i])].tolist())
                                      for i in range(len(prompts))]
        values = score(self.reward, completions, context)
        return (accumulator[0] + float(values.sum()), accumulator[1] + float(values.size))

    def result(self, accumulator: tuple[float, float]) -> float:
        total, count = accumulator
        return total / count if count else float("nan")


class GreedyRewardValidation:
    """Validation of a policy trained on a reward: held-out prompts continued greedily, then scored.

    The objectives that sample completions (GRPO and its family, PPO) mix it
    in before ``Objective``; it reads their fields of the same names.
    """

    model: nn.Module
    reward: str | Mapping[str, Any] | Reward  # what dew.rewards.resolve reads
    max_new_tokens: int
    tokenizer: Tokenizer | None
    stop_token: int | None
    prompt_key: str
    prompt_length_key: str

    def check_reward(self) -> None:
        """Refuse a reward of None as the objective is built: validation scores the greedy answers with
        it even where an environment scores the training episodes (found at the first evaluation, it
        was a TypeError's traceback)."""
        if self.reward is None:
            raise ValueError(f"{type(self).__name__}.reward is None: validation scores the policy's greedy answers "
                             "to held-out prompts with a reward, an environment's episodes or not. Name one "
                             "(objective.reward=exact_match, or a mapping with a name and its fields).")

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        """Held-out prompts continued greedily by the policy, for ``metrics`` to score."""
        return greedy_outputs(self.model, policy_variables(variables), batch, step.key,
                              self.max_new_tokens, self.prompt_key, self.prompt_length_key)

    def metrics(self) -> tuple[Metric, ...]:
        """The mean reward of the greedy completions of the validation prompts."""
        return (RewardMetric(resolve(self.reward), tokenizer=self.tokenizer, stop_token=self.stop_token),)


class PolicyRollout:
    """What a rollout that samples the live policy through the generation engine holds.

    ``CompletionRollout`` and ``EpisodeRollout`` share it: the model and its
    sampling settings (group_size samples per prompt, max_new_tokens each,
    ending at stop_token, or at the tokenizer's end ids without one), the
    batch keys the prompts are read from, the
    engine's layout (None: the rollout's own default) and the engine once
    built, the time spent in the reward (``reward_seconds``, its own row of
    the goodput split), the scorer of ``old_logp`` under the sampling policy,
    and the rounds scored since the journal last asked (``transcript()``).
    """

    def __init__(self, model: nn.Module, *, group_size: int, max_new_tokens: int, sampling: Sampling,
                 tokenizer: Tokenizer | None = None, stop_token: int | None = None, prompt_key: str = "prompt",
                 prompt_length_key: str = "prompt_length", engine: EngineConfig | None = None) -> None:
        self.model = model
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.stop_token = stop_token
        self.prompt_key = prompt_key
        self.prompt_length_key = prompt_length_key
        self.engine_config = engine
        self.engine: Engine | None = None
        self.reward_seconds = 0.0
        self.last_completions: list[str] = []
        self._rounds: deque[dict[str, object]] = deque(maxlen=_KEPT_ROUNDS)
        # old_logp at the temperature that sampled: the ratio's denominator is the sampling policy.
        temperature = float(sampling.temperature)
        self._score = jax.jit(lambda params, tokens: token_logprobs(model, params, tokens, temperature)[0])

    def transcript(self) -> list[dict[str, object]]:
        """What the calls since the last transcript scored, one mapping per call (then forgotten):
        ``prompts``, ``completions``, ``rewards`` and ``context`` (the batch's other keys)."""
        rounds = list(self._rounds)
        self._rounds.clear()
        return rounds

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """The ids that end a completion: stop_token, else the tokenizer's end ids (``ending_ids``)."""
        return ending_ids(self.stop_token, self.tokenizer)

    def read_prompts(self, batch: HostBatch) -> tuple[np.ndarray, np.ndarray]:
        """The batch's prompts (int32 [prompts, width], right-padded) and their lengths [prompts]."""
        for name in (self.prompt_key, self.prompt_length_key):
            if name not in batch:
                raise RolloutBatchError(
                    f"The rollout reads prompts under {self.prompt_key!r} (int32 [prompts, width], "
                    f"right-padded) and their lengths under {self.prompt_length_key!r}, but the batch "
                    f"holds {sorted(batch)}."
                )
        return (np.asarray(batch[self.prompt_key], np.int32),
                np.asarray(batch[self.prompt_length_key], np.int32).reshape(-1))


class CompletionRollout(PolicyRollout):
    """Sample group_size completions per prompt, score them, and lay them out for the step.

    engine sets the generation engine's layout (default: every completion of a
    step decoding at once, with room for all of them at full length).
    max_lag > 0 lets the trainer sample later steps' completions while a step
    trains (``dew.training.protocols.Lagging``); old_logp is always scored
    with the parameters that sampled.
    """

    def __init__(self, model: nn.Module, reward: Reward, *, group_size: int, max_new_tokens: int,
                 sampling: Sampling, tokenizer: Tokenizer | None = None, stop_token: int | None = None,
                 prompt_key: str = "prompt", prompt_length_key: str = "prompt_length",
                 engine: EngineConfig | None = None, max_lag: int = 0) -> None:
        super().__init__(model, group_size=group_size, max_new_tokens=max_new_tokens, sampling=sampling,
                         tokenizer=tokenizer, stop_token=stop_token, prompt_key=prompt_key,
                         prompt_length_key=prompt_length_key, engine=engine)
        self.reward = reward
        self.max_lag = max_lag

    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, np.ndarray | jax.Array]:
        prompts, lengths = self.read_prompts(batch)
        g, n = self.group_size, self.max_new_tokens
        prompts, lengths = np.repeat(prompts, g, axis=0), np.repeat(lengths, g, axis=0)
        params = {"params": state.params["params"]}
        new = self._sample(params, prompts[::g], lengths[::g], key)
        rows, width = prompts.shape
        tokens = np.zeros((rows, width + n), np.int32)
        mask = np.zeros((rows, width + n), np.float32)
        completions = []
        for i in range(rows):
            length, completion = int(lengths[i]), new[i]
            text, kept = completion_text(self.tokenizer, completion, self.stop_tokens)
            tokens[i, :length] = prompts[i, :length]
            tokens[i, length:length + n] = completion
            mask[i, length:length + kept] = 1.0
            completions.append(text)
        # A reward reads the batch's other keys, repeated per completion, as whatever they hold.
        context: dict[str, Any] = {k: np.repeat(np.asarray(v), g, axis=0) for k, v in batch.items()
                   if k not in (self.prompt_key, self.prompt_length_key)}
        context["prompt_text"] = [prompt_text(self.tokenizer, prompts[i, :int(lengths[i])].tolist())
                                  for i in range(rows)]
        began = time.perf_counter()
        rewards = score(self.reward, completions, context)
        self.reward_seconds += time.perf_counter() - began
        old_logp = self._score(params, jnp.asarray(tokens))
        self.last_completions = completions
        self._rounds.append({"prompts": context["prompt_text"], "completions": completions,
                             "rewards": np.asarray(rewards, np.float32).tolist(),
                             "context": {k: v for k, v in context.items() if k != "prompt_text"}})
        return {"tokens": tokens, "mask": mask, "reward": rewards, "old_logp": old_logp}

    def _sample(self, params: Variables, prompts: np.ndarray, lengths: np.ndarray,
                key: jax.Array) -> np.ndarray:
        """New tokens [prompts * group_size, max_new_tokens] (0 after a stop token), from the engine.

        Prompt i's group draws with ``fold_in(key, i)``, its sample j with ``fold_in(that, j)``.
        """
        g, n = self.group_size, self.max_new_tokens
        if self.engine is None:  # every prompt written in one call, every sample decoding at once
            steps = EngineConfig.steps_per_call
            config = self.engine_config or EngineConfig(
                max_batch=len(prompts) * g, max_len=prompts.shape[1] + n,
                block_size=min(16, prompts.shape[1] + n), prefill_rows=len(prompts),
                batch_buckets=min(4, -(-n // steps)))
            self.engine = Engine(self.model, config, vocab=drawable_vocab(self.tokenizer))
        self.engine.set_params(params)
        for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
            request = Request(tuple(prompt[: int(length)]), n, samples=g, sampling=self.sampling,
                              stop_tokens=self.stop_tokens)
            self.engine.submit(request, jax.random.fold_in(key, i))
        new = np.zeros((len(prompts) * g, n), np.int32)
        for row, completion in enumerate(self.engine.run()):
            new[row, : len(completion.tokens)] = completion.tokens
        return new
