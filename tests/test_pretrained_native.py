"""dew's own model layout read back bit for bit, by Pretrained and by TextGeneration with its
ByteTokenizer: the tokenizer is dew-data's and the generation dew-objectives', so this test
lives here (moved from dew-core/tests/test_pretrained.py)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from dew.pretrained import Pretrained
from perturbed import perturbed_init

PROMPTS = np.random.default_rng(0).integers(0, 61, (3, 19))


def _dew_logits(model, variables, ids=PROMPTS) -> np.ndarray:
    return np.asarray(model.apply(variables, jnp.asarray(ids, jnp.int32)))


def test_the_key_concepts_model_saves_in_dews_own_layout_and_reads_back_bit_for_bit(tmp_path):
    """The spec's example model (learned positions, GELU) has no Llama counterpart: its own format
    is dew's layout, which Pretrained.load and TextGeneration.load read back."""
    from safetensors.numpy import load_file

    from dew import models
    from dew.data import ByteTokenizer
    from dew.sampling import Sampling, TextGeneration, generate

    model = models.build("causal_transformer", vocab_size=257, emb_features=64, num_layers=2,
                         num_heads=4, mlp_features=256, max_seq_len=128)
    variables = perturbed_init(model)
    written = Pretrained(model, variables, ByteTokenizer()).save(tmp_path / "native")
    config = json.loads((written / "config.json").read_text())
    assert config["format"] == "dew" and config["model"]["name"] == "causal_transformer"
    stored = load_file(str(written / "model.safetensors"))  # each variable by its path, as it was
    flat = {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]}
    assert set(stored) == set(flat)
    assert all(np.array_equal(stored[name], flat[name]) for name in flat)
    loaded = Pretrained.load(written)
    assert loaded.model == model and isinstance(loaded.tokenizer, ByteTokenizer)
    np.testing.assert_array_equal(_dew_logits(loaded.model, loaded.variables, PROMPTS % 257),
                                  _dew_logits(model, variables, PROMPTS % 257))
    again = TextGeneration.load(written)
    expected = generate(model, variables, [[100, 101, 119]], 5, jax.random.key(0),
                        Sampling(temperature=0.0), eos_id=256)
    assert again("dew", max_new_tokens=5) == ByteTokenizer().decode(
        [t for t in expected.new_tokens[0] if t != 256])


def test_an_export_in_another_dew_layout_version_says_which_dew_reads_it(tmp_path):
    """A newer layout asks for a newer dew; an older one for an export again: neither is read as this one."""
    import pytest

    from dew import models
    from dew.pretrained import PretrainedError
    from dew.pretrained.native import VERSION

    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=16)
    written = Pretrained(model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))).save(tmp_path / "e")
    config = json.loads((written / "config.json").read_text())
    for version, advice in ((VERSION + 1, "Upgrade dew"), (VERSION - 1, "Export the run again with this dew")):
        (written / "config.json").write_text(json.dumps({**config, "version": version}))
        with pytest.raises(PretrainedError, match=f"layout version {version}; .*{advice}"):
            Pretrained.load(written)


def test_families_read_from_transformers_save_in_dews_layout_and_read_back_bit_for_bit(tmp_path):
    """A Gemma 2 model saved in dew's layout could not be read back (its 'geglu' activation was no
    choice of CausalTransformer's field), and a Llama with llama3 rope scaling could not be saved
    (a RopeScaling was no JSON value)."""
    from dew.families.examples import write_checkpoint

    for family in ("llama", "gemma2"):
        write_checkpoint(family, tmp_path / family)
        read = Pretrained.load(tmp_path / family)
        again = Pretrained.load(read.save(tmp_path / f"{family}-dew", format="dew"))
        assert again.model == read.model
        ids = PROMPTS % read.model.vocab_size
        np.testing.assert_array_equal(_dew_logits(again.model, again.variables, ids),
                                      _dew_logits(read.model, read.variables, ids))
    assert read.model.mlp_activation == "geglu"
    assert Pretrained.load(tmp_path / "llama").model.rope_scaling.kind == "llama3"
