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
goodput split shows it as its own row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.errors import BatchKeyError
from dew.objectives.policy import token_logprobs
from dew.rewards import Reward, score
from dew.sampling import Engine, EngineConfig, Request, Sampling

__all__ = ["CompletionRollout", "RolloutBatchError"]


# The batch a rollout receives lacks the prompts or their lengths: dew's one batch-key error.
RolloutBatchError = BatchKeyError


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if tokenizer is None:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
    return tokenizer.decode(list(ids))


class CompletionRollout:
    """Sample group_size completions per prompt, score them, and lay them out for the step.

    engine sets the generation engine's layout (default: every completion of a
    step decoding at once, with room for all of them at full length).
    """

    def __init__(self, model: nn.Module, reward: Reward, *, group_size: int, max_new_tokens: int,
                 sampling: Sampling, tokenizer: Any = None, stop_token: int | None = None,
                 prompt_key: str = "prompt", prompt_length_key: str = "prompt_length",
                 engine: EngineConfig | None = None) -> None:
        self.model = model
        self.reward = reward
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.stop_token = stop_token
        self.prompt_key = prompt_key
        self.prompt_length_key = prompt_length_key
        self.reward_seconds = 0.0
        self.engine_config = engine
        self.engine: Engine | None = None
        self._score = jax.jit(lambda params, tokens: token_logprobs(model, params, tokens)[0])

    def __call__(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
        for name in (self.prompt_key, self.prompt_length_key):
            if name not in batch:
                raise RolloutBatchError(
                    f"The rollout reads prompts under {self.prompt_key!r} (int32 [prompts, width], "
                    f"right-padded) and their lengths under {self.prompt_length_key!r}, but the batch "
                    f"holds {sorted(batch)}."
                )
        prompts = np.asarray(batch[self.prompt_key], np.int32)
        lengths = np.asarray(batch[self.prompt_length_key], np.int32).reshape(-1)
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
            kept, shown = n, completion
            if self.stop_token is not None:
                stops = np.flatnonzero(completion == self.stop_token)
                if stops.size:
                    kept, shown = int(stops[0]) + 1, completion[: int(stops[0])]
            tokens[i, :length] = prompts[i, :length]
            tokens[i, length:length + n] = completion
            mask[i, length:length + kept] = 1.0
            completions.append(_decode(self.tokenizer, shown.tolist()))
        # A reward reads the batch's other keys, repeated per completion, as whatever they hold.
        context: dict[str, Any] = {k: np.repeat(np.asarray(v), g, axis=0) for k, v in batch.items()
                   if k not in (self.prompt_key, self.prompt_length_key)}
        context["prompt_text"] = [_decode(self.tokenizer, prompts[i, :int(lengths[i])].tolist())
                                  for i in range(rows)]
        began = time.perf_counter()
        rewards = score(self.reward, completions, context)
        self.reward_seconds += time.perf_counter() - began
        old_logp = self._score(params, jnp.asarray(tokens))
        self.last_completions = completions
        return {"tokens": tokens, "mask": mask, "reward": rewards, "old_logp": old_logp}

    def _sample(self, params: Any, prompts: np.ndarray, lengths: np.ndarray,
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
            self.engine = Engine(self.model, config)
        self.engine.set_params(params)
        stops = () if self.stop_token is None else (int(self.stop_token),)
        for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
            request = Request(tuple(prompt[: int(length)]), n, samples=g, sampling=self.sampling,
                              stop_tokens=stops)
            self.engine.submit(request, jax.random.fold_in(key, i))
        new = np.zeros((len(prompts) * g, n), np.int32)
        for row, completion in enumerate(self.engine.run()):
            new[row, : len(completion.tokens)] = completion.tokens
        return new
