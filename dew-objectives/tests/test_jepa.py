"""JepaObjective: masks, the EMA target encoder against a hand computation, and a linear probe on digits."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.nn.vit import ViTEncoder
from dew.objectives.base import Step
from dew.objectives.jepa import JepaObjective, MaskCoversImageError, block_masks, collapse_metrics
from dew.registry import objectives

from .tuning_helpers import counting_dataset, digit_images

STEP = Step(step=jnp.int32(0), microstep=jnp.int32(0), updates=jnp.int32(0), key=jax.random.key(0))


def encoder(**overrides):
    fields = dict(image_size=8, patch=2, channels=1, emb_features=32, num_layers=2, num_heads=2, mlp_features=64)
    return ViTEncoder(**{**fields, **overrides})


def digits():
    return digit_images()


def digit_dataset(images, rows=64):
    return counting_dataset(
        lambda i: {"image": images[np.random.default_rng(i).choice(len(images), rows, replace=False)]}, rows)


def test_registered_and_every_parameter_has_logical_axes():
    assert objectives.load("jepa") is JepaObjective
    objective = JepaObjective(encoder(), blocks=3)
    abstract = jax.eval_shape(objective.init, jax.random.key(0))
    boxed = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxed and all(isinstance(x, nn.LogicallyPartitioned) for x in boxed)


def test_image_blocks_and_video_tubes_and_a_mask_over_the_whole_image_is_refused():
    masks = np.asarray(block_masks(jax.random.key(3), (1, 4, 4), 3, (2, 2)))
    assert masks.shape == (3, 16) and (masks.sum(1) == 4).all()
    for m in masks:  # each a 2x2 rectangle of the 4x4 grid
        rows, columns = np.nonzero(m.reshape(4, 4))
        assert np.ptp(rows) == 1 and np.ptp(columns) == 1
    tubes = np.asarray(block_masks(jax.random.key(3), (3, 4, 4), 3, (2, 2))).reshape(3, 3, 16)
    assert (tubes == tubes[:, :1]).all() and (tubes[:, 0] == masks).all()  # the same rectangle in every frame
    with pytest.raises(MaskCoversImageError, match=r"4 blocks of 2x2 patches can hide all 16 patches .* below 16"):
        JepaObjective(encoder(), blocks=4, block=(2, 2))
    with pytest.raises(MaskCoversImageError, match=r"1 blocks of 5x1 patches"):
        JepaObjective(encoder(), blocks=1, block=(5, 1))
    with pytest.raises(ValueError, match=r"pixel_std, which must be positive; got 0.0"):
        JepaObjective(encoder(), pixel_std=0.0)


@pytest.mark.slow
def test_the_context_encoder_sees_only_visible_patches_and_videos_train():
    model = encoder()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    pixels = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))
    visible = jnp.asarray(np.random.default_rng(0).random((2, 16)) < 0.5).at[:, 0].set(True)
    noise = jnp.where(jnp.repeat(jnp.repeat(~visible.reshape(2, 4, 4), 2, 1), 2, 2)[..., None], 5.0, 0.0)
    a, b = model.apply(variables, pixels, visible), model.apply(variables, pixels + noise, visible)
    np.testing.assert_allclose(np.asarray(a)[np.asarray(visible)], np.asarray(b)[np.asarray(visible)], atol=1e-5)
    video = JepaObjective(encoder(frames=4, tubelet=2), input_key="video", blocks=2)
    variables = nn.meta.unbox(video.init(jax.random.key(0)))
    loss, aux = video.loss(variables, {"video": jax.random.normal(jax.random.key(2), (2, 4, 8, 8, 1))}, STEP)
    assert float(loss.count) == 2 * 2 * 4 * 2 and np.isfinite(float(loss.value))  # rows x blocks x 4 patches x 2 times
    assert set(aux.metrics) >= {"embedding_std", "effective_rank"}


def test_collapse_metrics_tell_collapsed_from_spread_embeddings():
    collapsed = collapse_metrics(jnp.ones((32, 8)) + 1e-4 * jax.random.normal(jax.random.key(0), (32, 8)))
    spread = collapse_metrics(jax.random.normal(jax.random.key(1), (32, 8)))
    assert float(collapsed["embedding_std"]) < 1e-3 < 0.2 < float(spread["embedding_std"])
    assert float(spread["effective_rank"]) > 6.0


def momentum(updates, start, end, steps):
    progress = min(updates / steps, 1.0)
    return end - (end - start) * (np.cos(np.pi * progress) + 1) / 2


@pytest.mark.slow
def test_the_target_encoder_is_the_ema_of_the_context_encoder_at_every_step(tmp_path):
    images, _ = digits()
    objective = JepaObjective(encoder(emb_features=16, num_layers=1, mlp_features=32), blocks=3,
                              predictor_features=16, predictor_layers=1, momentum=(0.9, 1.0), momentum_steps=4)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    state, _, _ = trainer.place()
    target = jax.device_get(state.params)["params"]["encoder"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.ema)["params"]["encoder"], target)
    for step in range(1, 6):
        state = trainer.fit(digit_dataset(images, rows=16), steps=step, log_every=1, checkpoint_every=1)
        live = jax.device_get(state.params)["params"]["encoder"]
        rate = momentum(step - 1, 0.9, 1.0, 4)
        target = jax.tree.map(lambda t, p, r=rate: r * t + (1 - r) * p, target, live)
        kept = jax.device_get(state.ema)["params"]["encoder"]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), kept, target)
    assert "predictor" not in jax.device_get(state.ema)["params"]


@pytest.mark.slow
def test_a_linear_probe_on_the_trained_encoder_beats_one_on_a_random_encoder():
    """JEPA's target encoder gives digits features a linear probe separates far better than random encoders' do.

    The same ViT (with a learned position table) is probed before and after 1500 JEPA steps on the 1200 training
    digits (the objective standardizes pixels with the training images' mean and deviation, for every encoder);
    the probe is a logistic regression on standardized mean-pooled features, scored on the 597 held-out digits.
    The trained encoder must beat the best of four random initializations (the run's own and three others), not
    one chosen seed. Seen here: random 0.564-0.603 (0.563-0.625 over twelve seeds), trained target encoder
    0.742-0.752 (run keys 0, 1, 2).
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    images, labels = digits()
    train = images[:1200]  # JEPA sees the probe's training images only, never the held-out ones
    steps = 1500
    objective = JepaObjective(encoder(positions="learned"), blocks=3, momentum=(0.99, 1.0), momentum_steps=steps,
                              pixel_mean=float(train.mean()), pixel_std=float(train.std()))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, steps)
    trainer = Trainer(objective, optax.adamw(schedule, weight_decay=0.05), key=jax.random.key(0))
    randoms = [jax.device_get(trainer.place()[0].params)]
    randoms += [nn.meta.unbox(objective.init(jax.random.key(seed))) for seed in (1, 2, 3)]
    state = trainer.fit(digit_dataset(train), steps=steps, log_every=steps // 3)

    def probe(pipeline):  # the same pipeline, scaling and classifier for every encoder
        features = pipeline(images)
        scale = StandardScaler().fit(features[:1200])
        fit = LogisticRegression(max_iter=3000).fit(scale.transform(features[:1200]), labels[:1200])
        return fit.score(scale.transform(features[1200:]), labels[1200:])

    before = [probe(objective.pipeline(variables)) for variables in randoms]
    after = probe(objective.pipeline(state))
    print(f"linear probe accuracy on digits: random encoders {[round(b, 3) for b in before]}, "
          f"JEPA target encoder {after:.3f}")
    assert after > max(before) + 0.1  # seen: 0.747 against at best 0.598 (margin ~0.15)


@pytest.mark.slow
def test_the_target_encoder_is_a_feature_extractor_that_saves_and_loads(tmp_path):
    from dew.objectives.diffusion_pipeline import load_pipeline
    from dew.objectives.jepa import FeatureExtraction

    images, _ = digits()
    objective = JepaObjective(encoder(emb_features=16, num_layers=1, mlp_features=32), blocks=2,
                              predictor_features=16, predictor_layers=1, momentum=(0.5, 1.0), momentum_steps=4,
                              pixel_mean=0.3, pixel_std=0.4)
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0)).fit(digit_dataset(images, rows=16), steps=3,
                                                                             log_every=3)
    pipeline = objective.pipeline(state)
    assert isinstance(pipeline, FeatureExtraction) and set(pipeline.variables["params"]) == {"encoder"}
    features = pipeline(images[:40], batch=16)  # three batches, the last one short

    # Independently: the target encoder's (EMA) embeddings of the standardized pixels, averaged over the patches.
    target = jax.device_get(state.ema)["params"]["encoder"]
    by_hand = np.asarray(objective.model.apply({"params": target}, (images[:40] - 0.3) / 0.4)).mean(axis=1)
    assert features.shape == (40, 16)
    np.testing.assert_allclose(features, by_hand, rtol=1e-5, atol=1e-6)
    as_bytes = np.round(images[:40] * 255).astype(np.uint8)  # uint8 pixels are read as 0-255
    np.testing.assert_allclose(pipeline(as_bytes), np.asarray(objective.model.apply(
        {"params": target}, (as_bytes.astype(np.float32) / 255 - 0.3) / 0.4)).mean(axis=1), rtol=1e-5, atol=1e-6)
    live = objective.pipeline(state, ema=False)(images[:40])
    assert not np.allclose(live, features)  # the context encoder is another network

    pipeline.save(tmp_path / "encoder")
    loaded = load_pipeline(tmp_path / "encoder")
    assert isinstance(loaded, FeatureExtraction)
    assert loaded.objective.model.grid == objective.model.grid and loaded.objective.blocks == 2
    assert (loaded.objective.pixel_mean, loaded.objective.pixel_std) == (0.3, 0.4)
    np.testing.assert_array_equal(loaded(images[:40], batch=16), features)
