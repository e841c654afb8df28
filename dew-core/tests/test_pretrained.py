"""Pretrained against the real transformers: what dew writes, transformers reads, and back.

Every comparison is with transformers' own LlamaForCausalLM on CPU in fp32,
on a batch of prompts; round trips compare the arrays bit for bit.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import CausalTransformer
from dew.pretrained import (
    NoExactCounterpartError,
    Pretrained,
    TensorMismatchError,
    UnsupportedArchitectureError,
)
from perturbed import perturbed_init

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = np.random.default_rng(0).integers(0, 61, (3, 19))


def _llama(**overrides) -> CausalTransformer:
    fields = dict(vocab_size=61, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_features=48, max_seq_len=32, position_embedding="rotary",
                  mlp_activation="swiglu", rope_base=500.0, norm_epsilon=1e-5)
    return CausalTransformer(**{**fields, **overrides})


def _dew_logits(model, variables, ids=PROMPTS) -> np.ndarray:
    return np.asarray(model.apply(variables, jnp.asarray(ids, jnp.int32)))


def _hf_logits(directory, ids=PROMPTS) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.slow  # the first to import torch and transformers
@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    model = _llama(tie_embeddings=tied)
    variables = perturbed_init(model)
    Pretrained(model, variables).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is tied
    theirs = _hf_logits(tmp_path)
    ours = _dew_logits(model, variables)
    assert theirs.shape == ours.shape == (3, 19, 61)
    assert np.abs(theirs - ours).max() <= 1e-4


def test_every_exported_file_is_readable_as_the_umask_allows(tmp_path):
    """safetensors creates its files for their owner alone (0600), so an export in a shared folder
    held a config.json others could read beside weights they could not."""
    import os
    import stat

    model = _llama()
    Pretrained(model, perturbed_init(model)).save(tmp_path / "one")
    Pretrained(model, perturbed_init(model)).save(tmp_path / "shards", max_shard_bytes=20_000)
    mask = os.umask(0o022)
    os.umask(mask)
    files = [p for folder in ("one", "shards") for p in (tmp_path / folder).iterdir()]
    assert sum(p.suffix == ".safetensors" for p in files) > 2
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == \
        {p.name: oct(0o666 & ~mask) for p in files}


def _hf_saved(directory, **overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    hf.save_pretrained(directory)
    return hf.eval()


def test_a_model_transformers_initialized_loads_into_dew(tmp_path):
    hf = _hf_saved(tmp_path)
    loaded = Pretrained.load(tmp_path)
    assert loaded.model.num_kv_heads == 1 and loaded.model.rope_base == 1000.0
    assert loaded.model.norm_epsilon == 1e-5
    with torch.no_grad():
        theirs = hf(torch.tensor(PROMPTS)).logits.numpy()
    assert np.abs(_dew_logits(loaded.model, loaded.variables) - theirs).max() <= 1e-4


@pytest.mark.parametrize("fields", [
    {},
    {"num_kv_heads": None, "tie_embeddings": True, "dtype": jnp.bfloat16,
     "param_dtype": jnp.bfloat16},
], ids=["fp32-grouped", "bf16-tied"])
def test_dew_to_transformers_to_dew_is_bitwise(tmp_path, fields):
    model = _llama(**fields)
    variables = jax.tree.map(lambda leaf: leaf.astype(model.param_dtype), perturbed_init(model))
    Pretrained(model, variables).save(tmp_path / "dew")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dew")
    assert str(hf.dtype) == f"torch.{jnp.dtype(model.param_dtype).name}"
    hf.save_pretrained(tmp_path / "hf")  # transformers' own writer this time
    back = Pretrained.load(tmp_path / "hf")
    assert back.model == model
    original = jax.tree_util.tree_flatten_with_path(variables)[0]
    restored = dict(jax.tree_util.tree_flatten_with_path(back.variables)[0])
    assert len(original) == len(restored)
    for path, leaf in original:
        again = restored[path]
        assert again.dtype == leaf.dtype
        assert np.array_equal(np.asarray(again), np.asarray(leaf)), jax.tree_util.keystr(path)


@pytest.mark.parametrize("field, value", [("position_embedding", "learned"),
                                          ("mlp_activation", "gelu")])
def test_a_configuration_without_an_exact_counterpart_is_refused_naming_the_field(
        tmp_path, field, value):
    """Asked for the Hugging Face layout, a model that is no Llama is refused, writing nothing."""
    model = _llama(**{field: value})
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(NoExactCounterpartError, match=f"CausalTransformer.{field}='{value}'"):
        Pretrained(model, variables).save(tmp_path, format="hf")
    assert not (tmp_path / "model.safetensors").exists()


def test_an_unsupported_architecture_names_itself_and_the_supported_ones(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        Pretrained.load(tmp_path)


def test_a_missing_or_misshapen_tensor_names_its_path_and_shapes(tmp_path):
    from safetensors.numpy import load_file, save_file

    _hf_saved(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    shape = tensors[name].shape
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(TensorMismatchError, match=rf"{name} \(shape \({shape[0]}, {shape[1]}\)"):
        Pretrained.load(tmp_path)
    save_file({**tensors, name: tensors[name][:4]}, tmp_path / "model.safetensors")
    with pytest.raises(TensorMismatchError,
                       match=rf"{name} .* has shape \(4, 32\).* makes it \(8, 32\)"
                             r".*layers_1/attention/key of shape \(32, 1, 8\)"):
        Pretrained.load(tmp_path)




def test_param_dtype_casts_every_stored_weight_as_numpy_casts_it(tmp_path):
    """Loading float32 weights with param_dtype=bfloat16 gives each leaf, laid out in dew's
    layout or kept as stored, exactly numpy's cast of the float32 leaf."""
    model = _llama()
    variables = perturbed_init(model)
    Pretrained(model, variables).save(tmp_path / "fp32", format="hf")
    back = Pretrained.load(tmp_path / "fp32", param_dtype=jnp.bfloat16)
    original = jax.tree_util.tree_flatten_with_path(variables)[0]
    restored = dict(jax.tree_util.tree_flatten_with_path(back.variables)[0])
    assert len(original) == len(restored)
    for path, leaf in original:
        again = restored[path]
        assert again.dtype == jnp.bfloat16, jax.tree_util.keystr(path)
        expected = np.asarray(leaf).astype(jnp.bfloat16)
        assert np.array_equal(np.asarray(again).view(np.uint16), expected.view(np.uint16)), \
            jax.tree_util.keystr(path)
