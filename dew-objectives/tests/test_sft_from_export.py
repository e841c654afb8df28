"""The tiny-lm-sft recipe: `dew train` fine-tunes, on prompt/completion records, a model that
`dew export` wrote; it starts from exactly the exported weights and its loss falls.

The commands run through ``dew.cli.main`` in this process (the conftest's dew_command: the function
the console script calls), in the test's directory."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = ["model.emb_features=32", "model.num_heads=4", "model.mlp_features=64", "model.num_layers=1"]


def test_the_recipe_describes_the_model_tiny_lm_exports():
    from dew.recipes.config import RunConfig

    base, tuned = RunConfig.load("tiny-lm"), RunConfig.load("tiny-lm-sft")
    assert tuned.model == base.model
    assert tuned.init is not None and tuned.init.pretrained == "exported/tiny-lm"
    assert tuned.data.name == "prompt_completion" and tuned.objective.name == "lm"


@pytest.mark.slow
def test_dew_train_fine_tunes_what_dew_export_wrote(tmp_path, dew_command):
    from dew.data.base import DataPartition
    from dew.recipes.config import RunConfig
    from dew.recipes.run import build_parts

    def dew(*args: str) -> None:
        done = dew_command(*args, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

    dew("train", "tiny-lm", *SMALL, "trainer.steps=20", "trainer.log_every=10", "trainer.checkpoint_every=20",
        "trainer.checkpoint_dir=runs/tiny-lm/base", "data.files={stdlib}/a*.py", "objective.prompt=null")
    dew("export", "runs/tiny-lm/base", "exported/tiny-lm")
    overrides = [*SMALL, "trainer.steps=40", "trainer.log_every=1", "objective.prompt=null",
                 "trainer.checkpoint_dir=runs/sft", "trackers.0.directory=runs/sft"]
    dew("train", "tiny-lm-sft", *overrides)
    journal = [json.loads(line) for line in (tmp_path / "runs/sft/scalars.jsonl").read_text().splitlines()]
    losses = [row["train/loss"] for row in journal if "train/loss" in row]
    assert len(losses) == 40

    # Step 1 is scored by the exported weights: transformers' own cross-entropy of the first batch,
    # over the completion tokens only, each record attending within itself.
    recipe = RunConfig.load("tiny-lm-sft", overrides=overrides)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        batch = next(build_parts(recipe).dataset.train(DataPartition()))
    finally:
        os.chdir(cwd)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported/tiny-lm", dtype=torch.float32).eval()
    text, mask, segments = (np.asarray(batch[k]) for k in ("text", "loss_mask", "segment_ids"))
    total, count = 0.0, 0
    for row in range(text.shape[0]):
        for number in set(segments[row].tolist()) - {0}:
            where = np.nonzero(segments[row] == number)[0]
            ids = text[row, where]
            with torch.no_grad():
                logits = hf(torch.tensor(ids[None, :-1], dtype=torch.long)).logits[0]
            scored = mask[row, where][1:] == 1
            ce = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], dtype=torch.long), reduction="none")
            total += float(ce.numpy()[scored].sum())
            count += int(scored.sum())
    assert losses[0] == pytest.approx(total / count, abs=2e-4)
    # And it learns: the last five steps' loss is well below the first five's.
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    print(f"tiny-lm-sft from an export: loss {first:.3f} (steps 1-5) -> {last:.3f} (steps 36-40)")
    assert last < 0.7 * first
