"""The GRPO family: each variant's loss and gradient equal its paper's formula written out by hand;
incompatible options are refused naming the fields; DAPO's host-side filters do what the paper says.

The policy is a table of logits (``FixedLogits``), so each loss is checked as a function of fixed
logits, rewards and masks, on batches of two group sizes and lengths with padded completions (one
of them masked out entirely, as overlong filtering leaves a truncated completion)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import registry
from dew.objectives.group_sampling import (
    GroupFilter,
    IncompatibleOptionsError,
    OverlongShaping,
    overlong_penalty,
)
from dew.objectives.grpo import GRPOObjective
from dew.objectives.grpo_family import (
    CISPOObjective,
    DAPOObjective,
    DrGRPOObjective,
    GSPOObjective,
    RLOOObjective,
)

from .fixed_logits import FixedLogits, assert_tree_close, logits, logp_by_hand, step

VOCAB = 7
POLICY, REFERENCE = 2, 3  # seeds of the current policy's and the reference's logits
# (group size, rows, tokens per row, budget of new tokens)
BATCHES = {"G4": (4, 8, 10, 6), "G3": (3, 9, 7, 4)}


def _batch(name: str) -> dict[str, np.ndarray]:
    g, rows, length, _ = BATCHES[name]
    rng = np.random.default_rng(length)
    tokens = rng.integers(0, VOCAB, size=(rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.float32)
    for i in range(rows):
        mask[i, 3:length - (i % 3)] = 1.0  # completions of different lengths, right-padded
    if name == "G3":
        mask[4] = 0.0  # a completion removed from the loss (overlong filtering)
    reward = rng.choice([0.0, 0.5, 1.0], size=rows).astype(np.float32)
    reward[:g] = 1.0  # one group whose rewards are all equal
    # The sampling policy is the current one (POLICY) moved a little, so some ratios leave the clip range.
    old = np.asarray(logp_by_hand(logits(POLICY, rows, length, VOCAB), jnp.asarray(tokens)))
    old = old + rng.normal(scale=0.3, size=old.shape).astype(np.float32)
    return {"tokens": tokens, "mask": mask, "reward": reward, "old_logp": old.astype(np.float32)}


def _variants(g: int, budget: int, model) -> dict[str, tuple[object, dict]]:
    """Each variant, and the settings its formula below reads."""
    common = {"group_size": g, "max_new_tokens": budget}
    return {
        "grpo": (GRPOObjective(model, clip=0.2, clip_high=0.3, beta=0.1, **common),
                 dict(baseline="mean", scale=True, ratio="token", loss="clip", low=0.2, high=0.3, beta=0.1,
                      aggregate="token")),
        "grpo_sequence": (GRPOObjective(model, beta=0.1, normalize="sequence", **common),
                          dict(baseline="mean", scale=True, ratio="token", loss="clip", low=0.2, high=0.2,
                               beta=0.1, aggregate="sequence")),
        "dr_grpo": (DrGRPOObjective(model, **common),
                    dict(baseline="mean", scale=False, ratio="token", loss="clip", low=0.2, high=0.2, beta=0.0,
                         aggregate="budget")),
        "dapo": (DAPOObjective(model, stop_token=3, **common),
                 dict(baseline="mean", scale=True, ratio="token", loss="clip", low=0.2, high=0.28, beta=0.0,
                      aggregate="token")),
        "gspo": (GSPOObjective(model, clip_low=0.05, clip_high=0.08, **common),
                 dict(baseline="mean", scale=True, ratio="sequence", loss="clip", low=0.05, high=0.08, beta=0.0,
                      aggregate="sequence")),
        "gspo_token": (GSPOObjective(model, ratio="sequence_token", clip_low=0.05, clip_high=0.08, beta=0.1,
                                     **common),
                       dict(baseline="mean", scale=True, ratio="sequence_token", loss="clip", low=0.05, high=0.08,
                            beta=0.1, aggregate="sequence")),
        "rloo": (RLOOObjective(model, **common),
                 dict(baseline="leave_one_out", scale=False, ratio="token", loss="clip", low=0.2, high=0.2,
                      beta=0.04, aggregate="sum")),
        "cispo": (CISPOObjective(model, **common),
                  dict(baseline="mean", scale=True, ratio="token", loss="cispo", low=1.0, high=0.28, beta=0.0,
                       aggregate="token")),
    }


def _advantages(reward: np.ndarray, g: int, baseline: str, scale: bool) -> list[float]:
    """Each row's advantage, group by group, as the papers write it."""
    out = []
    for start in range(0, len(reward), g):
        r = [float(x) for x in reward[start:start + g]]
        mean = sum(r) / g
        std = (sum((x - mean) ** 2 for x in r) / (g - 1)) ** 0.5  # the sample std, as TRL takes it
        for i in range(g):
            base = (sum(r) - r[i]) / (g - 1) if baseline == "leave_one_out" else mean
            a = r[i] - base
            out.append(a / (std + 1e-4) if scale else a)
    return out


def _by_hand(table, ref_table, batch, s: dict, budget: int):
    """The variant's loss and clip fraction, row by row over each row's completion tokens."""
    tokens, mask = jnp.asarray(batch["tokens"]), batch["mask"][:, 1:]
    logp = logp_by_hand(table, tokens)
    ref = jax.lax.stop_gradient(logp_by_hand(ref_table, tokens))
    old = jnp.asarray(batch["old_logp"])
    rows, g = mask.shape[0], s["g"]
    adv = _advantages(batch["reward"], g, s["baseline"], s["scale"])
    low, high = 1.0 - s["low"], 1.0 + s["high"]
    sums, lengths, clipped = [], [], []
    for i in range(rows):
        kept = np.flatnonzero(mask[i] > 0)
        lengths.append(len(kept))
        if not len(kept):
            sums.append(0.0)
            continue
        lp, ol = logp[i, kept], old[i, kept]
        seq = jnp.sum(lp - ol) / len(kept)  # GSPO's length-normalized log-ratio
        if s["ratio"] == "token":
            rho = jnp.exp(lp - ol)
        elif s["ratio"] == "sequence":
            rho = jnp.full(len(kept), jnp.exp(seq))
        else:  # GSPO-token: sg[s_i] * pi / sg[pi]
            rho = jnp.exp(jax.lax.stop_gradient(seq)) * jnp.exp(lp - jax.lax.stop_gradient(lp))
        if s["loss"] == "cispo":
            terms = -jax.lax.stop_gradient(jnp.clip(rho, low, high)) * adv[i] * lp
        else:
            terms = -jnp.minimum(rho * adv[i], jnp.clip(rho, low, high) * adv[i])
        if s["beta"]:
            d = ref[i, kept] - lp
            terms = terms + s["beta"] * (jnp.exp(d) - d - 1.0)
        sums.append(jnp.sum(terms))
        clipped.append(jax.lax.stop_gradient((rho < low) | (rho > high)))
    if s["aggregate"] == "token":
        loss = sum(sums) / sum(lengths)
    elif s["aggregate"] == "sequence":
        loss = sum(t / n for t, n in zip(sums, lengths, strict=True) if n) / rows
    elif s["aggregate"] == "budget":  # Dr.GRPO: sum over tokens / the generation budget, mean over rows
        loss = sum(sums) / budget / rows
    else:  # RLOO: each completion's summed log-probability, mean over completions
        loss = sum(sums) / rows
    return loss, jnp.mean(jnp.concatenate(clipped).astype(jnp.float32))


@pytest.mark.parametrize("shape", sorted(BATCHES))
def test_each_variant_loss_and_gradient_equal_its_formula(shape):
    g, rows, length, budget = BATCHES[shape]
    model = FixedLogits(rows, length, VOCAB)
    batch = _batch(shape)
    table, ref_table = logits(POLICY, rows, length, VOCAB), logits(REFERENCE, rows, length, VOCAB)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    seen_clipping = set()
    for name, (objective, settings) in _variants(g, budget, model).items():
        settings = {**settings, "g": g}
        variables = {"params": {"logits": table}}
        if objective.beta > 0:
            variables["reference"] = {"logits": ref_table}

        def through_objective(t, objective=objective, variables=variables):
            return objective.loss({**variables, "params": {"logits": t}}, jbatch, step())[0].value

        def written(t, settings=settings):
            return _by_hand(t, ref_table, batch, settings, budget)

        got, got_grad = jax.value_and_grad(through_objective)(table)
        (expected, fraction), expected_grad = jax.value_and_grad(written, has_aux=True)(table)
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=name)
        assert_tree_close(got_grad, expected_grad)
        assert float(jnp.abs(got_grad).max()) > 0, name
        fraction = float(fraction)
        metrics = objective.loss(variables, jbatch, step())[1].metrics
        np.testing.assert_allclose(metrics["clip_fraction"].value, fraction, rtol=1e-5, err_msg=name)
        if 0 < fraction < 1:
            seen_clipping.add(name)
    # The fixtures exercise both sides of every variant's clip range.
    assert seen_clipping == set(_variants(g, budget, model)), seen_clipping


def test_variants_are_registered_objectives_with_their_papers_settings():
    names = registry.objectives.names()
    for name, cls in (("dr_grpo", DrGRPOObjective), ("dapo", DAPOObjective), ("gspo", GSPOObjective),
                      ("rloo", RLOOObjective), ("cispo", CISPOObjective)):
        assert names[name] == "dew-objectives"
        assert registry.objectives.load(name) is cls
    model = FixedLogits(2, 4, VOCAB)
    dapo = registry.objectives.build("dapo", model=model, stop_token=3)
    assert dapo.bounds == (0.2, 0.28) and dapo.dynamic_sampling and dapo.overlong == "penalty"
    assert dapo.beta == 0 and dapo.normalize == "token"
    assert isinstance(dapo.rollout(), GroupFilter)
    assert GSPOObjective(model).bounds == (3e-4, 4e-4)


def test_incompatible_options_are_refused_naming_the_fields():
    model = FixedLogits(2, 4, VOCAB)
    with pytest.raises(IncompatibleOptionsError, match=r"GSPOObjective\.ratio='token' is token-level clipping"):
        registry.objectives.build("gspo", model=model, ratio="token")
    with pytest.raises(IncompatibleOptionsError, match=r"policy_loss='cispo'.*ratio='sequence'"):
        GRPOObjective(model, policy_loss="cispo", ratio="sequence")
    with pytest.raises(IncompatibleOptionsError, match=r"dynamic_sampling=True needs group_size >= 2.*group_size=1"):
        registry.objectives.build("dapo", model=model, group_size=1, stop_token=3)
    with pytest.raises(IncompatibleOptionsError, match=r"overlong='mask' needs stop_token"):
        GRPOObjective(model, overlong="mask")
    # A tokenizer's end id is a stop too: shaping counts a completion ending there as finished.
    from dew.data import ByteTokenizer

    shaped = GRPOObjective(model, overlong="mask", tokenizer=ByteTokenizer()).rollout()
    assert shaped.shaping.stops == (ByteTokenizer().eos_id,)
    with pytest.raises(ValueError, match="overlong_buffer must lie in"):
        GRPOObjective(model, overlong="penalty", stop_token=3, max_new_tokens=4, overlong_buffer=5)
    # Options nothing would read: each trained bitwise as without it (DAPO's clip=0.05 kept (0.2, 0.28)).
    for build, said in (
            (lambda: registry.objectives.build("dapo", model=model, stop_token=3, clip=0.05),
             r"DAPOObjective would train as without clip=0.05 \(clip_low=0.2 and clip_high=0.28 bound the ratio"),
            (lambda: registry.objectives.build("gspo", model=model, clip=0.05), r"without clip=0.05"),
            (lambda: GRPOObjective(model, length_normalizer=100.0),
             r"without length_normalizer=100.0 \(it divides normalize='constant' alone; normalize='token'\)"),
            (lambda: GRPOObjective(model, max_sampling_rounds=8), r"max_sampling_rounds=8 \(it bounds dynamic_sampling"),
            (lambda: GRPOObjective(model, stop_token=3, overlong="mask", overlong_penalty=0.5),
             r"overlong_penalty and overlong_buffer \(they shape overlong='penalty'; overlong='mask'\)")):
        with pytest.raises(IncompatibleOptionsError, match=said) as refused:
            build()
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"overlong_penalty must be at least 0, got -1.0: below 0 it pays"):
        GRPOObjective(model, stop_token=3, overlong="penalty", overlong_penalty=-1.0)
    with pytest.raises(IncompatibleOptionsError, match=r"overlong='penalty' measures a completion .* environment"):
        GRPOObjective(model, stop_token=3, overlong="penalty", environment="calculator")
    # Both bounds given, clip left alone: accepted; one bound given, clip is the other's default.
    assert GRPOObjective(model, clip_low=0.1, clip_high=0.3).bounds == (0.1, 0.3)
    assert GRPOObjective(model, clip=0.1, clip_high=0.3).bounds == (0.1, 0.3)


def test_a_reward_of_none_is_refused_as_the_objective_is_built_environment_or_not():
    """reward=None beside an environment passed dew train --check and ended the run in a TypeError's
    traceback at its first evaluation: validation scores the greedy answers with the reward."""
    from dew.objectives.ppo import PPOObjective
    from dew.objectives.rollouts import GreedyRewardValidation

    model = FixedLogits(2, 4, VOCAB)
    for build in (lambda: GRPOObjective(model, reward=None, environment="calculator"),
                  lambda: GRPOObjective(model, reward=None),
                  lambda: registry.objectives.build("ppo", model=model, reward=None)):
        with pytest.raises(ValueError, match=r"Objective\.reward is None: validation scores the policy's greedy "
                                             r"answers.*objective\.reward=exact_match"):
            build()
    assert issubclass(PPOObjective, GreedyRewardValidation)
    assert GRPOObjective(model, environment="calculator").reward == "exact_match"  # the default stands


def test_overlong_penalty_is_dapos_soft_punishment():
    budget, cache = 16, 4
    lengths = np.arange(0, 20)
    expected = [0.0 if n <= budget - cache else ((budget - cache) - n) / cache if n <= budget else -1.0
                for n in lengths]
    np.testing.assert_allclose(overlong_penalty(lengths, budget, cache), expected, rtol=1e-6)


def test_overlong_shaping_penalizes_or_masks_truncated_completions():
    stop = 9
    tokens = np.array([[1, 2, 9, 0, 0, 0], [1, 5, 5, 5, 9, 0], [1, 5, 5, 5, 5, 5]], np.int32)
    mask = np.array([[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], np.float32)
    reward = np.array([1.0, 1.0, 0.0], np.float32)
    shaping = OverlongShaping("penalty", max_new_tokens=5, buffer=2, penalty=0.5, stops=(stop,))
    shaped, same_mask, truncated = shaping(tokens, mask, reward)
    # lengths 2, 4, 5 within a budget of 5 and a buffer of 2: 0, -0.5, -1 (times 0.5)
    np.testing.assert_allclose(shaped, [1.0, 0.75, -0.5])
    assert truncated.tolist() == [0.0, 0.0, 1.0] and same_mask is mask
    masking = OverlongShaping("mask", max_new_tokens=5, buffer=2, penalty=0.5, stops=(stop,))
    kept, masked, _ = masking(tokens, mask, reward)
    np.testing.assert_array_equal(kept, reward)  # the reward still counts in its group
    np.testing.assert_array_equal(masked, mask * np.array([[1], [1], [0]], np.float32))


class _Sampler:
    """Groups of 2 per prompt: a prompt's rewards are all equal when its id is even."""

    def __init__(self):
        self.calls = []

    def __call__(self, state, batch, key):
        ids = np.asarray(batch["prompt"])[:, 0]
        self.calls.append((ids.tolist(), np.asarray(jax.random.key_data(key)).tolist()))
        rows = np.repeat(ids, 2)
        reward = np.where(rows % 2 == 0, 1.0, np.tile([0.0, 1.0], len(ids))).astype(np.float32)
        tokens = np.repeat(rows[:, None], 3, axis=1).astype(np.int32)
        return {"tokens": tokens, "mask": np.ones((len(rows), 3), np.float32), "reward": reward,
                "old_logp": np.zeros((len(rows), 2), np.float32)}


def _prompts(*ids):
    return {"prompt": np.asarray(ids, np.int32)[:, None], "prompt_length": np.ones(len(ids), np.int32)}


def test_dynamic_sampling_drops_equal_groups_and_refills_from_the_stream():
    sampler = _Sampler()
    rollout = GroupFilter(sampler, group_size=2, dynamic=True, max_rounds=4)
    stream = iter([_prompts(4, 5, 6, 7), _prompts(8, 9, 10, 11)])
    rollout.draw_from(lambda: next(stream))
    key = jax.random.key(3)
    out = rollout(None, _prompts(0, 1, 2, 3), key)
    # Two rounds fill the 4 groups with the odd prompts; the 4 even ones are dropped.
    np.testing.assert_array_equal(out["tokens"][::2, 0], [1, 3, 5, 7])
    assert out["reward"].tolist() == [0.0, 1.0] * 4
    assert out["dropped_groups"].tolist() == [4.0] * 8 and out["sampling_rounds"].tolist() == [2.0] * 8
    assert out["filler_groups"].tolist() == [0.0] * 8
    np.testing.assert_allclose(out["sampled_reward"], (4 * 2 + 4 * 1) / 16)
    assert [ids for ids, _ in sampler.calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    expected_keys = [np.asarray(jax.random.key_data(k)).tolist() for k in (key, jax.random.fold_in(key, 1))]
    assert [k for _, k in sampler.calls] == expected_keys
    assert next(stream)["prompt"][0, 0] == 8  # the stream was read no further than needed


def test_dynamic_sampling_fills_with_equal_groups_when_its_rounds_run_out():
    sampler = _Sampler()
    rollout = GroupFilter(sampler, group_size=2, dynamic=True, max_rounds=3)  # no stream: the same prompts again
    out = rollout(None, _prompts(0, 1, 2, 4), jax.random.key(0))
    assert len(sampler.calls) == 3 and all(ids == [0, 1, 2, 4] for ids, _ in sampler.calls)
    np.testing.assert_array_equal(out["tokens"][::2, 0], [1, 1, 1, 0])  # three varied groups, one filler
    assert out["filler_groups"][0] == 1 and out["dropped_groups"][0] == 3 * 3 - 1
    assert out["tokens"].shape == (8, 3)  # the shape of every step


def test_dew_train_refuses_incompatible_options_before_writing_anything(tmp_path, monkeypatch, capsys):
    from dew.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "addition-dapo", "objective.group_size=1"]) != 0
    said = capsys.readouterr().err
    assert "DAPOObjective.dynamic_sampling=True needs group_size >= 2" in said and "Traceback" not in said
    assert not (tmp_path / "runs").exists()


def test_the_filter_passes_on_the_reward_time_its_sampler_declares():
    """GroupFilter reports the reward seconds of a sampler that keeps them (dew.training's
    RewardTimed), so the goodput split counts them apart; a plain function sampler has none."""

    class Timed:
        reward_seconds = 1.25

        def __call__(self, state, batch, key):
            return {}

    assert GroupFilter(Timed(), group_size=2, dynamic=True).reward_seconds == 1.25
    assert GroupFilter(lambda state, batch, key: {}, group_size=2, dynamic=True).reward_seconds == 0.0


def test_settings_under_which_a_group_trains_nothing_are_refused():
    """Greedy completions of one prompt are one text (every advantage 0), a negative KL weight rewards
    drifting away, no new token leaves nothing to score, a stop id outside the vocabulary never stops."""
    from dew.models import build

    model = FixedLogits(2, 4, VOCAB)
    with pytest.raises(ValueError, match=r"GRPOObjective\.temperature must be above 0, got 0.*every advantage is 0"):
        GRPOObjective(model, temperature=0.0)
    with pytest.raises(ValueError, match=r"GRPOObjective\.beta, the KL penalty's weight, must be at least 0"):
        GRPOObjective(model, beta=-1.0)
    with pytest.raises(ValueError, match=r"GRPOObjective\.max_new_tokens must be at least 1"):
        GRPOObjective(model, max_new_tokens=0)
    lm = build("causal_transformer", vocab_size=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16,
               max_seq_len=12)
    with pytest.raises(ValueError, match=r"stop_token=300 is outside the model's vocabulary \[0, 16\)"):
        GRPOObjective(lm, stop_token=300)
    # Completions as long as the model's window leave no prompt room: every prompt was refused at the first rollout.
    with pytest.raises(ValueError, match=r"max_new_tokens=12 leaves no position for a prompt in the model's "
                                         r"max_seq_len=12"):
        GRPOObjective(lm, max_new_tokens=12)
    GRPOObjective(lm, max_new_tokens=11)
    GRPOObjective(lm, stop_token=15, beta=0.0)  # the edges are accepted
