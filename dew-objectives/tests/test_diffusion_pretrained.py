"""Diffusion pipelines save through Pretrained in dew's own layout and load back to the same samples.

Each pipeline (class- and text-to-image, video, masked- and block-diffusion
text) is saved, read back by ``Pretrained.load`` and by the pipeline's own
``load``, and must give the very samples the saved pipeline gave. The
tensors are read independently with the safetensors library: one per
variable, named by its path, holding the variable's bytes.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from dew import Pretrained
from dew.data import ByteTokenizer
from dew.nn.dit import DiT, VideoDiT
from dew.nn.token_denoiser import TokenDenoiser
from dew.objectives.block_diffusion import BlockDiffusionObjective
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.diffusion_pipeline import (
    DiffusionPipeline,
    PipelineFormatError,
    TextDiffusionPipeline,
)
from dew.objectives.masked_diffusion import MaskedDiffusionObjective
from dew.pretrained import PretrainedError, TensorMismatchError

SMALL = dict(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1, num_heads=2,
             mlp_features=32)


def _paths(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        out.update(_paths(value, path) if isinstance(value, dict) else {path: np.asarray(value)})
    return out


def _saved_as_variables(directory, variables):
    """The safetensors file holds each variable under its path, bit for bit."""
    stored = load_file(str(directory / "model.safetensors"))
    expected = _paths(jax.device_get(nn.meta.unbox(variables)))
    assert set(stored) == set(expected)
    for name, value in expected.items():
        assert stored[name].dtype == value.dtype and np.array_equal(stored[name], value), name


def _round_trip(objective, tmp_path, sample):
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    variables = jax.tree.map(lambda v: v + 0.01 * jax.random.normal(jax.random.key(3), v.shape), variables)
    pipeline = objective.pipeline(variables)
    expected = sample(pipeline)
    written = pipeline.save(tmp_path / "saved")
    config = json.loads((written / "config.json").read_text())
    assert config["format"] == "dew"
    _saved_as_variables(written, variables)

    loaded = Pretrained.load(written)
    assert loaded.model == objective.model
    again = loaded.pipeline()
    assert type(again) is type(pipeline) and again.objective == objective
    got = sample(again)
    if isinstance(expected, list):
        assert got == expected
    else:
        np.testing.assert_array_equal(got, expected)
    got = sample(type(pipeline).load(written))
    assert got == expected if isinstance(expected, list) else np.array_equal(got, expected)
    return config


@pytest.mark.slow
def test_class_to_image_round_trip(tmp_path):
    objective = DiffusionObjective(DiT(**SMALL, num_classes=3), sample_steps=3, guidance=2.0,
                                   schedule="flow", sampler="heun")
    config = _round_trip(objective, tmp_path, lambda p: p([0, 2, 1], key=jax.random.key(4)))
    assert config["model"] == {"name": "dit", "fields": {**SMALL, "num_classes": 3, "text_vocab_size": 0,
                                                         "text_length": 0, "text_layers": 1}}
    assert config["task"]["name"] == "diffusion" and config["task"]["fields"]["guidance"] == 2.0


@pytest.mark.slow
def test_text_to_image_round_trip_keeps_the_tokenizer(tmp_path):
    tokenizer = ByteTokenizer()
    model = DiT(**SMALL, text_vocab_size=tokenizer.vocab_size, text_length=6)
    objective = DiffusionObjective(model, tokenizer=tokenizer, sample_steps=2, guidance=1.5)
    _round_trip(objective, tmp_path, lambda p: p(["a zero", "a seven"], key=jax.random.key(1)))
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    assert type(Pretrained.load(tmp_path / "saved").tokenizer).__name__ == "ByteTokenizer"


@pytest.mark.slow
def test_video_round_trip(tmp_path):
    model = VideoDiT(frames=3, **SMALL, num_classes=2)
    objective = DiffusionObjective(model, sample_steps=2)
    _round_trip(objective, tmp_path, lambda p: p([1, 0], key=jax.random.key(2)))


@pytest.mark.parametrize("kind", ["masked", "block"])
def test_text_diffusion_round_trip(kind, tmp_path):
    tokenizer = ByteTokenizer()
    model = TokenDenoiser(vocab_size=tokenizer.vocab_size, emb_features=16, num_layers=1,
                          num_heads=2, mlp_features=32, max_seq_len=8)
    if kind == "masked":
        objective = MaskedDiffusionObjective(model, seq_len=8, tokenizer=tokenizer, preview_steps=4)
    else:
        objective = BlockDiffusionObjective(model, seq_len=8, block_size=4, tokenizer=tokenizer,
                                            preview_steps=2)
    _round_trip(objective, tmp_path, lambda p: p(3, key=jax.random.key(5)))


def test_bad_directories_are_refused_naming_the_problem(tmp_path):
    objective = DiffusionObjective(DiT(**SMALL, num_classes=3), sample_steps=2)
    variables = nn.meta.unbox(objective.init(jax.random.key(0)))
    bare = Pretrained(objective.model, variables).save(tmp_path / "bare")  # no task recorded
    with pytest.raises(PretrainedError, match="record no task"):
        Pretrained.load(bare).pipeline()

    narrower = DiT(**{**SMALL, "emb_features": 8}, num_classes=3)
    wrong = Pretrained(narrower, variables, task={"name": "diffusion", "fields": {}})
    with pytest.raises(TensorMismatchError,
                       match=r"params/blocks_0/attention/key: shape \(16, 2, 8\), expected \(8, 2, 4\)"):
        wrong.pipeline()

    text = MaskedDiffusionObjective(TokenDenoiser(vocab_size=20, emb_features=16, num_layers=1,
                                                  num_heads=2, mlp_features=32, max_seq_len=8),
                                    seq_len=8)
    text.pipeline(nn.meta.unbox(text.init(jax.random.key(0)))).save(tmp_path / "text")
    with pytest.raises(PipelineFormatError, match="holds a TextDiffusionPipeline, not a DiffusionPipeline"):
        DiffusionPipeline.load(tmp_path / "text")
    assert isinstance(TextDiffusionPipeline.load(tmp_path / "text"), TextDiffusionPipeline)
