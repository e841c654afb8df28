"""DPO and GRPO with LoRA: the reference policy is the base model without adapters, held once."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.adapters.lora import Lora, adapters_only, apply_lora, base_model, is_adapter
from dew.data import Dataset
from dew.objectives.base import Step
from dew.objectives.dpo import DPOObjective, sequence_logprob
from dew.objectives.grpo import GRPOObjective
from dew.objectives.policy import token_logprobs
from dew.training import trees

pytest.importorskip("qwix")

SEQ, ROWS = 8, 4


def nbytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def wrapped_model():
    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32, max_seq_len=16)
    return apply_lora(model, Lora(rank=2, alpha=4.0, targets=("attention", "mlp")))


def pairs(index: int) -> dict:
    rng = np.random.default_rng(index)
    chosen = rng.integers(0, 32, (ROWS, SEQ)).astype(np.int32)
    rejected = chosen.copy()
    rejected[:, 4:] = rng.integers(0, 32, (ROWS, SEQ - 4))
    mask = np.zeros((ROWS, SEQ), np.int32)
    mask[:, 4:] = 1
    return {"chosen": chosen, "rejected": rejected, "chosen_mask": mask, "rejected_mask": mask,
            "prompt_length": np.full((ROWS,), 4, np.int32)}


def step() -> Step:
    zero = jnp.zeros((), jnp.int32)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))


def base_only(variables):
    return trees.select(nn.meta.unbox(variables), lambda path, leaf: not is_adapter(path, leaf))


@pytest.mark.slow
def test_dpo_with_lora_holds_no_reference_copy_and_scores_against_the_base_model():
    wrapped = wrapped_model()

    def batches():
        index = 0
        while True:
            yield pairs(index)
            index += 1

    data = Dataset(train=lambda partition: batches(), batch=ROWS)
    objective = adapters_only(DPOObjective(model=wrapped, seq_len=SEQ, beta=0.5))
    state = Trainer(objective, optax.adam(5e-2), key=jax.random.key(0)).fit(data, steps=4, log_every=4)
    params = jax.device_get(nn.meta.unbox(state.params))
    # One copy: the state's variables are the base and the adapters, nothing else.
    assert sorted(params) == ["params"]
    adapters = trees.select(params, is_adapter)
    assert nbytes(params) == nbytes(base_only(params)) + nbytes(adapters)
    # Without LoRA the same objective keeps the reference: a second copy of every weight.
    plain = DPOObjective(model=base_model(wrapped), seq_len=SEQ, beta=0.5).init(jax.random.key(0))
    assert nbytes(plain) == 2 * nbytes(base_only(params))

    # The reference is the base model alone: precomputed with the plain model on the base weights,
    # the loss of the same policy is the one the adapted run computes.
    batch = pairs(99)
    ours, aux = objective.loss(params, batch, step())
    plain_model = base_model(wrapped)
    ref_c, _ = sequence_logprob(plain_model, base_only(params), batch["chosen"], batch["chosen_mask"])
    ref_r, _ = sequence_logprob(plain_model, base_only(params), batch["rejected"], batch["rejected_mask"])
    precomputed = DPOObjective(model=wrapped, seq_len=SEQ, beta=0.5, reference="precomputed")
    theirs, _ = precomputed.loss(params, {**batch, "chosen_reference_logp": ref_c,
                                          "rejected_reference_logp": ref_r}, step())
    np.testing.assert_allclose(float(ours.value), float(theirs.value), rtol=1e-5, atol=1e-6)
    assert abs(float(aux.metrics["reward_margin"].value)) > 1e-3  # the adapters moved the policy


def test_grpo_with_lora_holds_no_reference_copy_and_measures_kl_to_the_base_model():
    wrapped = wrapped_model()
    objective = adapters_only(GRPOObjective(model=wrapped, group_size=2, beta=0.1))
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    assert sorted(variables) == ["params"]
    # Trained adapters: B moved off zero, so policy and reference differ.
    keys = iter(jax.random.split(jax.random.key(7), 64))
    variables = jax.tree_util.tree_map_with_path(
        lambda path, x: 0.3 * jax.random.normal(next(keys), x.shape)
        if str(getattr(path[-1], "key", "")).endswith("_lora_b") else x, variables)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, SEQ)), jnp.int32)
    policy_logp, _ = token_logprobs(wrapped, variables, tokens)
    batch = {"tokens": tokens, "mask": jnp.ones((4, SEQ), jnp.int32),
             "reward": jnp.asarray([1.0, 0.0, 0.0, 1.0]), "old_logp": policy_logp}
    _, aux = objective.loss(variables, batch, step())
    reference_logp, _ = token_logprobs(base_model(wrapped), base_only(variables), tokens)
    delta = reference_logp - policy_logp
    expected = float(jnp.mean(jnp.exp(delta) - delta - 1.0))
    assert expected > 1e-4
    np.testing.assert_allclose(float(aux.metrics["kl"].value), expected, rtol=1e-5)
