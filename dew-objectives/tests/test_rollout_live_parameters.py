"""A rollout that samples from a language model reads the live parameters, and the step compiles once (it needs LMObjective and dew.sampling)."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.data import Dataset
from dew.objectives.base import Objective


class Counter(Objective):
    """A tiny LM objective around a causal transformer, counting traces of its loss."""

    def __init__(self):
        from dew.objectives.lm import LMObjective

        self.model = models.build("causal_transformer", vocab_size=16, emb_features=16, num_layers=1,
                                  num_heads=2, mlp_features=32, max_seq_len=16)
        self.lm = LMObjective(self.model, seq_len=8)
        self.traces = 0

    def init(self, key, variables=None):
        return self.lm.init(key, variables)

    def loss(self, variables, batch, step):
        self.traces += 1
        return self.lm.loss(variables, batch, step)

    def required_keys(self):
        return ("text",)


@pytest.mark.slow
def test_a_rollout_samples_with_the_live_parameters_and_the_step_compiles_once():
    from dew.sampling import Sampling, generate

    objective = Counter()
    prompts = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    seen = []

    def rollout(state, batch, key):
        params = jax.device_get(state.params)
        out = generate(objective.model, state.params, prompts, max_new_tokens=6, key=key,
                       sampling=Sampling(temperature=0))
        seen.append((params, np.asarray(out.tokens)))
        return {"text": batch["text"], "sample": np.asarray(out.tokens, np.int32)}

    # The model learns to count on from each prompt; the rollout's samples show it learning.
    text = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
    data = Dataset(train=lambda p: itertools.repeat({"text": text}), batch=2)
    trainer = Trainer(objective, optax.adam(0.05), key=jax.random.key(0), rollout=rollout)
    trainer.fit(data, steps=30, log_every=30)
    assert objective.traces == 1
    # Each sample is what generate makes from the parameters the step received.
    for params, tokens in (seen[0], seen[-1]):
        again = generate(objective.model, params, prompts, max_new_tokens=6, key=jax.random.key(9),
                         sampling=Sampling(temperature=0))
        np.testing.assert_array_equal(np.asarray(again.tokens), tokens)
    assert not np.array_equal(seen[0][1], seen[-1][1]), "samples did not follow the training"
    np.testing.assert_array_equal(seen[-1][1], text)
