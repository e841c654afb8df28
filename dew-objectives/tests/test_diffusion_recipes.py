"""The diffusion recipes: class-conditional digits learned well enough for a classifier to read
the samples; moving digits, masked and block diffusion train and write previews in the run directory;
flow-grpo-digits raises the brightness of the digits the digits-diffusion run draws.

The digits-diffusion run is trained once (a module fixture) and read by both of its tests: the
class accuracy of its samples, and the flow-grpo-digits recipe that starts from it.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dew.recipes.config import RunConfig
from dew.recipes.run import build_objective, train
from dew.training.initializers import ParamsFrom


def _run(name, tmp_path, overrides=()):
    config = RunConfig.load(name, [f"trackers.0.directory={tmp_path}/run",
                                   f"trainer.checkpoint_dir={tmp_path}/run", *overrides])
    state = train(config)
    return config, state


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, object, Path]:
    """The digits-diffusion recipe trained for 450 of its 1500 steps (the cosine schedule
    shortened with them, its peak learning rate 3e-3 for the recipe's 2e-3), its run folder at
    runs/digits-diffusion under the returned root."""
    root = tmp_path_factory.mktemp("digits")
    run = root / "runs" / "digits-diffusion"
    config = RunConfig.load("digits-diffusion", [f"trackers.0.directory={run}", f"trainer.checkpoint_dir={run}",
                                                 "trainer.steps=450", "trainer.eval_every=450",
                                                 "optimizer.learning_rate=3.0e-3"])
    return config, train(config), root


@pytest.mark.slow
def test_digits_samples_are_the_classes_asked_for(digits):
    from sklearn.linear_model import LogisticRegression

    from dew import models, registry
    from dew.data.digits import digit_images

    # After 450 steps these samples read 89.5% right (500 steps: 99%; 400 at 4e-3: 85%; the
    # recipe's own 2e-3 over 650 steps: 99.5%, over 550: 75.5%); before the labels are learned,
    # 12-15% (chance is 10%). From the 450-step run, FlowGRPO's 16 steps raise the brightness
    # 0.328 -> 0.414 (the test asks for 0.05).
    config, state, root = digits
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

    run = root / "runs" / "digits-diffusion"
    previews = [json.loads(line) for line in (run / "previews.jsonl").read_text().splitlines()]
    assert previews and all((run / p["path"]).is_file() for p in previews), previews
    # `dew report` on the run shows each drawn digit on its own, enlarged, captioned with its label.
    shown = _report(run, root / "report")
    captions = [caption for _, caption in shown]
    assert previews[-1]["labels"] and {str(x) for x in previews[-1]["labels"]} <= set(captions), captions
    assert all(image["width"] >= 64 for image, _ in shown)  # the 8-pixel digits, drawn at 96


def _report(run: Path, out: Path) -> list[tuple[dict[str, object], str]]:
    """Each preview picture on the page `dew report RUN` writes (its format, frames and width),
    with its caption."""
    import re

    from PIL import Image

    from dew.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", str(run), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    figures = re.findall(r"<img class='preview' src='([^']+)'[^>]*>(?:<figcaption class='label'>([^<]*)"
                         r"</figcaption>)?", page)
    assert figures, page[:2000]
    pictures = []
    for source, caption in figures:
        with Image.open(out / source) as image:
            pictures.append(({"format": image.format, "frames": getattr(image, "n_frames", 1),
                              "width": image.width}, caption))
    return pictures


@pytest.mark.slow
def test_flow_grpo_raises_the_brightness_of_digits(digits, monkeypatch):
    # The second stage runs from its shipped recipe in the digits run's root, so its
    # ``init: run: runs/digits-diffusion`` finds the first stage's checkpoint; the reward is read
    # back from the local tracker's scalars.
    root = digits[2]
    monkeypatch.chdir(root)
    with contextlib.redirect_stdout(io.StringIO()):
        state = train(RunConfig.load("flow-grpo-digits", ["trainer.steps=16", "trainer.log_every=1"]))
    rows = [json.loads(line) for line in
            (root / "runs" / "flow-grpo-digits" / "scalars.jsonl").read_text().splitlines()]
    reward = np.asarray([row["train/reward"] for row in rows if "train/reward" in row])
    assert len(reward) == 16
    start, end = reward[:4].mean(), reward[-4:].mean()
    assert end > start + 0.05, reward

    # The frozen reference is the digits run's EMA copy (init.ema), the weights its samples and its
    # export are drawn with, read as `dew generate` reads them; its live weights differ.
    from dew.recipes.opening import open_run

    drawn = open_run(root / "runs" / "digits-diffusion")
    live = ParamsFrom(root / "runs" / "digits-diffusion")({"params": jax.device_get(state.params["reference"])})
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(live), jax.tree.leaves(drawn.variables),
                                                       strict=True))
    for kept, read in zip(jax.tree.leaves(jax.device_get(state.params["reference"])),
                          jax.tree.leaves(jax.device_get(drawn.variables["params"])), strict=True):
        np.testing.assert_array_equal(kept, read)


def test_flow_grpo_with_lora_takes_the_base_as_its_reference(digits, monkeypatch, capsys):
    """FlowGRPO under LoRA kept the reference its init drew at random (a first KL of 1.7, where the same
    run without LoRA starts at 0): a LoRA run's reference is its base, the adapters' B at zero."""
    root = digits[2]
    monkeypatch.chdir(root)
    with contextlib.redirect_stdout(io.StringIO()):
        state = train(RunConfig.load("flow-grpo-digits", [
            "trainer.steps=1", "trainer.log_every=1", "data.batch=2", "trainer.checkpoint_dir=runs/flow-lora",
            "trackers.0.directory=runs/flow-lora",
            r"lora={rank: 4, targets: ['blocks_\d+/attention', 'blocks_\d+/mlp_in', 'blocks_\d+/mlp_out']}"]))
    rows = [json.loads(line) for line in (root / "runs" / "flow-lora" / "scalars.jsonl").read_text().splitlines()]
    assert abs(next(row["train/kl"] for row in rows if "train/kl" in row)) < 1e-6
    assert "reference" not in state.params  # no second copy of the weights
    # PEFT's adapters are for transformers' language models: said so, not "drop --format hf".
    from dew.cli import main

    assert main(["export", "runs/flow-lora", "adapters", "--adapters"]) == 2
    assert "drop --adapters to export it with its adapters merged" in capsys.readouterr().err


# moving-digits on clips of 4 frames, not the recipe's 8 (half the step's cost): the last ten
# losses' mean over the first ten's, seeds 0 and 1, was 0.572 and 0.541 at 4 frames, 0.583 and
# 0.553 at 8 (the test asks under 0.7); the GIFs still have several frames.
@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("moving-digits", ["trainer.steps=60", "trainer.eval_every=60", "trainer.log_every=1",
                       "data.batch=16", "data.frames=4", "model.frames=4", "objective.sample_steps=4",
                       "objective.preview_count=2"]),
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
    if name == "moving-digits":  # `dew report` shows the clips as moving GIFs, enlarged
        shown = _report(tmp_path / "run", tmp_path / "report")
        assert all(image["format"] == "GIF" and image["frames"] > 1 and image["width"] >= 64
                   for image, _ in shown), shown


def test_a_recipes_average_forgets_its_start_within_the_steps_its_page_trains():
    """moving-digits kept the diffusion objective's default EMA (0.999): after the 300 steps its
    page trains, 74% of the average dew generate and dew export draw from was still the initial
    weights, and its clips were noise whatever the label, steps or guidance. Every recipe whose
    objective keeps an average must leave at most a tenth of its start by the steps its page
    (docs/cli.md) trains, or by its own steps."""
    import dataclasses
    import re

    from dew import registry
    from dew.objectives.base import EMASpec
    from dew.recipes.config import shipped

    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    documented = {name: int(steps) for name, steps in re.findall(r"dew train ([a-z0-9-]+) trainer\.steps=(\d+)", page)}
    checked = {}
    for name in shipped():
        config = RunConfig.load(name, [])
        cls = registry.objectives.load(config.objective.name)
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if "ema" not in fields:
            continue
        field = fields["ema"]
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        given = config.objective.fields.get("ema", default)
        if given is True:
            given = default if isinstance(default, EMASpec) else EMASpec()
        if isinstance(given, dict):
            given = EMASpec(**given)
        if not isinstance(given, EMASpec) or callable(given.decay):
            continue
        steps = min(documented.get(name, config.trainer.steps), config.trainer.steps)
        checked[name] = given.decay ** steps
    assert "moving-digits" in checked and "digits-diffusion" in checked
    assert all(left <= 0.1 for left in checked.values()), checked

