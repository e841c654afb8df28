"""The diffusion recipes: class-conditional digits learned well enough for a classifier to read
the samples; moving digits, masked and block diffusion train and write previews in the run directory."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dew.recipes.config import RunConfig
from dew.recipes.run import build_objective, train


def _run(name, tmp_path, overrides=()):
    config = RunConfig.load(name, [f"trackers.0.directory={tmp_path}/run",
                                   f"trainer.checkpoint_dir={tmp_path}/run", *overrides])
    state = train(config)
    return config, state


@pytest.mark.slow
def test_digits_samples_are_the_classes_asked_for(tmp_path):
    from sklearn.linear_model import LogisticRegression

    from dew import models, registry
    from dew.data.digits import digit_images

    # 650 of the recipe's 1500 steps (the cosine schedule shortened with them): these samples
    # read 99.5% right (800 steps: 100%; 550: 75.5%); at 300 steps, before the labels are
    # learned, 12-15% (chance is 10%).
    config, state = _run("digits-diffusion", tmp_path, ["trainer.steps=650", "trainer.eval_every=650"])
    model = models.build(config.model.name, **config.model.fields)
    reader = registry.datasets.build(config.data.name, **config.data.fields)
    objective = build_objective(config, model, reader)

    # An independent judge: logistic regression on the real digits (about 97% on held-out ones).
    images, labels = digit_images()
    judge = LogisticRegression(max_iter=3000).fit(images.reshape(len(images), -1) / 255.0, labels)
    asked = np.arange(200) % 10
    samples = objective.pipeline(state)(list(asked), key=jax.random.key(11))
    assert samples.shape == (200, 8, 8, 1) and samples.dtype == np.uint8
    read = judge.predict(samples.reshape(200, -1) / 255.0)
    accuracy = float(np.mean(read == asked))
    assert accuracy >= 0.8, accuracy

    previews = [json.loads(line) for line in (tmp_path / "run" / "previews.jsonl").read_text().splitlines()]
    assert previews and all((tmp_path / "run" / p["path"]).is_file() for p in previews), previews


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("moving-digits", ["trainer.steps=60", "trainer.eval_every=60", "trainer.log_every=1",
                       "data.batch=16", "objective.sample_steps=4", "objective.preview_count=2"]),
    ("masked-diffusion", ["trainer.steps=60", "trainer.eval_every=60", "trainer.log_every=1",
                          "data.files={stdlib}/a*.py", "objective.preview_steps=8"]),
    ("block-diffusion", ["trainer.steps=60", "trainer.eval_every=60", "trainer.log_every=1",
                         "data.files={stdlib}/a*.py", "objective.preview_steps=2"]),
])
def test_recipe_learns_and_writes_previews(name, overrides, tmp_path):
    _run(name, tmp_path, overrides)
    rows = [json.loads(line) for line in (tmp_path / "run" / "scalars.jsonl").read_text().splitlines()]
    losses = np.asarray([row["train/loss"] for row in rows if "train/loss" in row])
    # Every step's loss, compared as the means of the first and last ten: one step's diffusion
    # loss (its noise levels drawn per row) moves by +-10% from the next, as much as the 60 steps
    # lower it once past the first ten, so two single steps measured the draw, not the learning.
    first, last = losses[:10].mean(), losses[-10:].mean()
    assert len(losses) == 60 and last < 0.7 * first, (first, last, losses.round(3).tolist())
    previews = [json.loads(line) for line in (tmp_path / "run" / "previews.jsonl").read_text().splitlines()]
    assert previews and all((tmp_path / "run" / p["path"]).is_file() for p in previews), previews
    suffix = ".gif" if name == "moving-digits" else ".txt"
    assert any(p["path"].endswith(suffix) for p in previews), previews
