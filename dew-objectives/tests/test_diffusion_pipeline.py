"""Pipelines sample class-conditional images and text, and save/load through Pretrained in dew's
own layout."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from dew.data import ByteTokenizer
from dew.inputs import InvalidConditionError
from dew.nn.dit import DiT
from dew.nn.token_denoiser import TokenDenoiser
from dew.objectives.block_diffusion import BlockDiffusionObjective
from dew.objectives.diffusion import DiffusionObjective, GuidanceError
from dew.objectives.diffusion_pipeline import load_pipeline

DIT = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1, num_heads=2,
          mlp_features=32, num_classes=3)


def test_class_pipeline_saves_and_loads_to_the_same_samples(tmp_path):
    objective = DiffusionObjective(DIT, sample_steps=3, guidance=2.0)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    pipeline = objective.pipeline(variables)
    images = pipeline([0, 2, 1], key=jax.random.key(4))
    assert images.shape == (3, 8, 8, 1) and images.dtype == np.uint8
    pipeline.save(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model"]["name"] == "dit" and config["task"]["name"] == "diffusion"
    loaded = load_pipeline(tmp_path / "saved")
    np.testing.assert_array_equal(loaded([0, 2, 1], key=jax.random.key(4)), images)
    with pytest.raises(InvalidConditionError, match=r"holds 3.*num_classes=3"):
        pipeline([3])


def test_many_samples_are_drawn_a_chunk_at_a_time(monkeypatch):
    """A count past CHUNK_ROWS is drawn in chunks, so the sampler's memory is a chunk's: each call of
    the objective's sampler takes at most CHUNK_ROWS rows (a thousand images were one program of a
    thousand rows, which XLA aborted on), the first chunk is what one call draws with the key, the
    next what the sampler draws with the key folded by its index."""
    from dew.objectives import diffusion_pipeline
    from dew.objectives.diffusion import to_pixels

    monkeypatch.setattr(diffusion_pipeline, "CHUNK_ROWS", 4)
    objective = DiffusionObjective(DIT, sample_steps=2, guidance=2.0)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    sampled = []
    sample = objective.sample
    monkeypatch.setattr(DiffusionObjective, "sample",
                        lambda self, *args, **kw: sampled.append(args[3]) or sample(*args, **kw))
    labels = [0, 1, 2, 0, 1, 2]
    images = objective.pipeline(variables)(labels, key=jax.random.key(4))
    assert images.shape == (6, 8, 8, 1) and sampled == [4, 2]
    condition = objective.conditioning.of(labels)
    first = sample(variables, jax.random.key(4), condition[:4], 4, guidance=2.0)
    rest = sample(variables, jax.random.fold_in(jax.random.key(4), 1), condition[4:], 2, guidance=2.0)
    np.testing.assert_array_equal(images, np.concatenate([to_pixels(first), to_pixels(rest)]))


def test_guidance_on_an_unconditional_pipeline_is_refused():
    model = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1,
                num_heads=2, mlp_features=32)
    objective = DiffusionObjective(model, sample_steps=2)
    pipeline = objective.pipeline(nn.meta.unbox(objective.init(jax.random.key(0))))
    assert pipeline(rows=2).shape == (2, 8, 8, 1)
    with pytest.raises(GuidanceError, match="guidance=4.0 was asked of an unconditional model"):
        pipeline(rows=2, guidance=4.0)


def test_block_diffusion_pipeline_writes_text(tmp_path):
    tokenizer = ByteTokenizer()
    model = TokenDenoiser(vocab_size=tokenizer.vocab_size, emb_features=16, num_layers=1,
                          num_heads=2, mlp_features=32, max_seq_len=8)
    objective = BlockDiffusionObjective(model, seq_len=8, block_size=4, tokenizer=tokenizer,
                                        preview_steps=2)
    pipeline = objective.pipeline(nn.meta.unbox(objective.init(jax.random.key(0))))
    texts = pipeline(2, key=jax.random.key(1))
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    pipeline.save(tmp_path / "text")
    again = load_pipeline(tmp_path / "text")  # the tokenizer is saved beside the weights
    assert again(2, key=jax.random.key(1)) == texts
