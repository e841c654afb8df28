"""DiffusionObjective: its loss against a hand computation, its buckets, previews and bad input."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.diffusion import VPCosine
from dew.inputs import InvalidConditionError
from dew.nn.dit import ConditionError, DiT, VideoDiT
from dew.nn.unet import UNet
from dew.objectives.base import Step
from dew.objectives.diffusion import (
    DiffusionObjective,
    GuidanceError,
    InvalidPixelsError,
    MissingPixelsError,
    ModelFrameCountError,
)

DIT = DiT(image_size=8, channels=1, patch_size=2, emb_features=32, num_layers=1, num_heads=2,
          mlp_features=64, num_classes=10)
STEP = Step(step=jnp.int32(0), microstep=jnp.int32(0), updates=jnp.int32(0), key=jax.random.key(3))


def init(objective):
    return nn.meta.unbox(jax.jit(objective.init)(jax.random.key(0)))


def images(rows=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (rows, 8, 8, 1)).astype(np.uint8),
            "label": np.arange(rows, dtype=np.int32) % 10}


@pytest.mark.parametrize("target", ["eps", "v"])
def test_loss_matches_a_hand_computation(target):
    objective = DiffusionObjective(DIT, target=target, condition_dropout=0.0)
    variables = init(objective)
    batch = images()
    loss, _ = jax.jit(objective.loss)(variables, batch, STEP)

    # By hand: the same draws, the cosine schedule written out, the model called directly.
    noise_key, _ = jax.random.split(STEP.key)
    time_key, eps_key = jax.random.split(noise_key)
    t = jax.random.uniform(time_key, (4,), jnp.float32) * (1 - 1e-3) + 1e-3
    s = 0.008
    alpha = np.cos(np.pi / 2 * (t + s) / (1 + s)) / np.cos(np.pi / 2 * s / (1 + s))
    alpha = np.clip(alpha, 1e-3, 1.0)
    sigma = np.sqrt(1 - alpha**2)
    eps = jax.random.normal(eps_key, (4, 8, 8, 1))
    x0 = batch["image"].astype(np.float32) / 127.5 - 1
    a, sg = alpha[:, None, None, None], sigma[:, None, None, None]
    x = a * x0 + sg * eps
    inputs = x / np.sqrt(a**2 * 0.25 + sg**2)
    out = DIT.apply(variables, inputs, t, batch["label"])
    goal = eps if target == "eps" else a * eps - sg * x0
    expected = np.mean((np.asarray(out) - np.asarray(goal)) ** 2)
    np.testing.assert_allclose(float(loss.value), expected, rtol=2e-5)
    assert float(loss.count) == 4


def test_validation_buckets_partition_the_loss():
    objective = DiffusionObjective(DIT, noise_buckets=4)
    variables = init(objective)
    outputs = jax.jit(objective.evaluate)(variables, images(8), STEP)
    buckets = [outputs[f"loss_noise_{k}"] for k in range(4)]
    assert [float(b.count) for b in buckets] == [2.0, 2.0, 2.0, 2.0]
    np.testing.assert_allclose(sum(float(b.total) for b in buckets), float(outputs["loss"].total),
                               rtol=1e-5)
    assert {m.name for m in objective.metrics()} == {"loss", *(f"loss_noise_{k}" for k in range(4))}


def test_condition_dropout_trains_the_null_label():
    objective = DiffusionObjective(DIT, condition_dropout=1.0)
    variables = init(objective)
    batch = images()
    dropped, _ = jax.jit(objective.loss)(variables, batch, STEP)
    null = dict(batch, label=np.full(4, 10, np.int32))
    kept, _ = jax.jit(DiffusionObjective(DIT, condition_dropout=0.0).loss)(variables, null, STEP)
    np.testing.assert_allclose(float(dropped.value), float(kept.value), rtol=1e-6)


@pytest.mark.slow
def test_previews_are_a_grid_and_a_gif():
    objective = DiffusionObjective(DIT, preview_count=4, sample_steps=2)
    artifact = objective.preview(init(objective), jax.random.key(1))
    assert (artifact.kind, artifact.data.shape, artifact.data.dtype) == ("image", (8, 32, 1), np.uint8)
    # each cell of the grid, row by row, says the class it was drawn for (a report shows it)
    assert artifact.labels == ("class 0", "class 1", "class 2", "class 3") and artifact.columns == 4
    video = VideoDiT(frames=3, image_size=8, channels=1, patch_size=4, emb_features=16,
                     num_layers=1, num_heads=2, mlp_features=32)
    objective = DiffusionObjective(video, schedule="flow", preview_count=2, sample_steps=2)
    artifact = objective.preview(init(objective), jax.random.key(1))
    assert (artifact.kind, artifact.data.shape) == ("video", (3, 8, 16, 1))
    assert (artifact.labels, artifact.columns) == ((), None)  # unconditional: nothing to name


@pytest.mark.slow
def test_unet_trains_through_the_same_objective():
    model = UNet(image_size=8, channels=1, features=8, multipliers=(1, 2), emb_features=16,
                 num_classes=10)
    objective = DiffusionObjective(model, schedule="edm", weighting="edm", target="x0")
    variables = init(objective)
    loss, _ = jax.jit(objective.loss)(variables, images(), STEP)
    assert np.isfinite(float(loss.value))
    grads = jax.grad(lambda v: objective.loss(v, images(), STEP)[0].total)(variables)
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))


def test_every_parameter_is_named_by_logical_axes():
    for model, objective in [(DIT, DiffusionObjective(DIT)),
                             (UNet(image_size=8, channels=1, features=8, emb_features=16),
                              None)]:
        objective = objective or DiffusionObjective(model)
        abstract = jax.eval_shape(objective.init, jax.random.key(0))
        leaves = jax.tree_util.tree_leaves(abstract["params"],
                                           is_leaf=lambda x: isinstance(x, nn.Partitioned))
        assert leaves and all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)


def test_bad_input_names_the_key_the_value_and_what_was_expected():
    objective = DiffusionObjective(DIT)
    variables = init(objective)
    floats = dict(images(), image=images()["image"].astype(np.float32))
    with pytest.raises(InvalidPixelsError, match=r"'image' holds float32 .* expected uint8 in \[0, 255\]"):
        objective.loss(variables, floats, STEP)
    with pytest.raises(MissingPixelsError, match="under the batch key 'image'"):
        objective.loss(variables, {"label": np.zeros(4, np.int32)}, STEP)
    with pytest.raises(InvalidConditionError, match=r"'label' holds 12.*num_classes=10.*\[0, 9\]"):
        objective.loss(variables, dict(images(), label=np.asarray([1, 2, 3, 12], np.int32)), STEP)
    # A training step is checked on the host before it runs (the trainer calls check_batch);
    # inside a compiled evaluation the check calls back to the host and its message comes through.
    with pytest.raises(InvalidConditionError, match=r"'label' holds 12.*num_classes=10"):
        objective.check_batch(dict(images(), label=np.asarray([1, 2, 3, 12], np.int32)), 0)
    with pytest.raises(Exception, match=r"'label' holds 12.*num_classes=10"):
        jax.block_until_ready(jax.jit(objective.evaluate)(
            variables, dict(images(), label=np.asarray([1, 2, 3, 12], np.int32)), STEP))

    video = VideoDiT(frames=3, image_size=8, channels=1, patch_size=4, emb_features=16,
                     num_layers=1, num_heads=2, mlp_features=32)
    clips = DiffusionObjective(video)
    with pytest.raises(ModelFrameCountError, match=r"'video' holds videos of 5 frames.*frames=3"):
        clips.loss(init(clips), {"video": np.zeros((2, 5, 8, 8, 1), np.uint8)}, STEP)

    unconditional = DiT(image_size=8, channels=1, patch_size=2, emb_features=16, num_layers=1,
                        num_heads=2, mlp_features=32)
    with pytest.raises(GuidanceError, match=r"guidance=3.0 .* unconditional model"):
        DiffusionObjective(unconditional, guidance=3.0)
    plain = DiffusionObjective(unconditional)
    with pytest.raises(GuidanceError, match="guidance=2.0"):
        plain.sample(init(plain), jax.random.key(0), rows=2, guidance=2.0, steps=2)
    # A scale that is no number wrote all-black images (NaN cast to uint8), the objective's and dew generate's.
    for scale in (float("nan"), float("inf")):
        with pytest.raises(GuidanceError, match=rf"guidance={scale} is no scale: give a finite number"):
            DiffusionObjective(unconditional, guidance=scale)
        with pytest.raises(GuidanceError, match="is no scale"):
            plain.sample(init(plain), jax.random.key(0), rows=2, guidance=scale, steps=2)
    with pytest.raises(ConditionError, match="built unconditional"):
        unconditional.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,)),
                           jnp.zeros((1,), jnp.int32))

    # Refused as the objective is built, where a run trained on regardless: a modality the model does not
    # draw (an AttributeError traceback at the first step), guidance a model trained without dropping
    # its condition never learned the null of, and schedule settings no process has.
    with pytest.raises(ValueError, match=r"modality='video', but the model, DiT, draws images \(it has no frames\)"):
        DiffusionObjective(DIT, modality="video")
    with pytest.raises(ValueError, match=r"modality='image', but the model, VideoDiT, draws clips of 3 frames"):
        DiffusionObjective(video, modality="image")
    assert DiffusionObjective(video, modality="video").shape == (3, 8, 8, 1)
    with pytest.raises(GuidanceError, match=r"guidance=3.0 .*condition_dropout=0.*train with condition_dropout "
                       r"above 0 \(0\.1 is usual\), or use guidance=1\.0 \(a recipe's objective\.guidance\)\.$"):
        DiffusionObjective(DIT, guidance=3.0, condition_dropout=0.0)
    undropped = DiffusionObjective(DIT, condition_dropout=0.0)
    with pytest.raises(GuidanceError, match="condition_dropout=0"):
        undropped.check_guidance(2.0)  # what dew generate --guidance asks of the run's objective
    for schedule, said in (({"name": "edm", "sigma_min": 5, "sigma_max": 1},
                            r"The edm schedule's sigma_min \(5\) must be above 0 and below sigma_max \(1\)\."),
                           ({"name": "edm", "sigma_max": "20"}, r"edm schedule's sigma_max must be a finite number, got '20'"),
                           ({"name": "flow", "t_max": 2}, r"flow schedule's t_max must be between 1e-5 and 1"),
                           ({"name": "vp_linear", "beta_max": 0.05}, r"beta_min \(0\.1\) must be at least 0 and below "
                                                                     r"beta_max \(0\.05\)"),
                           ({"name": "vp_cosine", "alpha_min": 0}, r"vp_cosine schedule's alpha_min must be between 0 and 1")):
        with pytest.raises(ValueError, match=said):
            DiffusionObjective(DIT, schedule=schedule)


def test_schedule_objects_and_names_agree():
    by_name = DiffusionObjective(DIT, schedule="vp_cosine")
    by_object = DiffusionObjective(DIT, schedule=VPCosine())
    variables = init(by_name)
    a, _ = by_name.loss(variables, images(), STEP)
    b, _ = by_object.loss(variables, images(), STEP)
    assert float(a.value) == float(b.value)


@pytest.mark.slow
def test_text_conditioning_trains_with_a_frozen_encoder():
    import itertools

    import optax

    from dew import Trainer
    from dew.data import Dataset

    model = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1,
                num_heads=2, mlp_features=32, text_vocab_size=20, text_length=5)
    objective = DiffusionObjective(model, freeze_text_encoder=True, ema=None)
    rng = np.random.default_rng(0)
    batch = {"image": rng.integers(0, 256, (4, 8, 8, 1)).astype(np.uint8),
             "caption": rng.integers(0, 20, (4, 5)).astype(np.int32)}
    start = init(objective)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), initializer=start)
    state = trainer.fit(Dataset(train=lambda _: itertools.repeat(batch), batch=4), steps=3,
                        log_every=3)
    after = jax.device_get(nn.meta.unbox(state.params))
    for name, leaf in jax.tree_util.tree_leaves_with_path(start["params"]["text"]):
        path = [k.key for k in name]
        kept = after["params"]["text"]
        for part in path:
            kept = kept[part]
        np.testing.assert_array_equal(kept, leaf)
    assert not np.array_equal(after["params"]["patch"]["kernel"], start["params"]["patch"]["kernel"])
    with pytest.raises(InvalidConditionError, match=r"'caption' holds token id 21.*text_vocab_size=20"):
        objective.loss(start, dict(batch, caption=np.full((4, 5), 21, np.int32)), STEP)
