"""LoRA on DeepSeek's latent attention, decoded.

The cached decode path multiplies slices of the key/value up-projection (the absorbed form of
multi-head latent attention), which qwix's LoRA einsum could not match to the adapted weight:
every sample of a DeepSeek run with attention adapters, its closing preview and `dew generate`
stopped with an einsum error. Decoded, the adapted model must give each new token the
log-probability a full forward pass of the same adapted model gives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("qwix")

from dew.adapters.lora import Lora  # noqa: E402
from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)
from dew.pretrained import Pretrained  # noqa: E402
from dew.sampling import Sampling, generate  # noqa: E402
from dew.testing.adapters import drawn_adapters  # noqa: E402


def test_decoding_an_adapted_latent_attention_scores_as_its_full_forward_pass(tmp_path):
    loaded = Pretrained.load(write_checkpoint("deepseek_v3", tmp_path / "deepseek", seed=2, redrawn=True))
    assert loaded.model.attention_block == "latent"
    adapted, variables = drawn_adapters(loaded.model, loaded.variables,
                                        Lora(rank=2, alpha=4.0, targets=("attention",)), scale=0.3)
    assert "kv_up_lora_a" in variables["params"]["layers_0"]["attention"]
    prompt = [5, 6, 7, 8, 9]
    out = generate(adapted, variables, [prompt], 6, jax.random.key(0), Sampling(temperature=0.0))
    tokens = out.tokens[0]
    full = jax.jit(adapted.apply)(variables, jnp.asarray([tokens[:-1]], jnp.int32))[0]
    logp = np.asarray(jax.nn.log_softmax(full.astype(jnp.float32), axis=-1))
    expected = [logp[i - 1, tokens[i]] for i in range(len(prompt), len(tokens))]
    np.testing.assert_allclose(out.logprobs[0], expected, atol=1e-4)
    # The adapters matter to what is decoded: the base model scores these tokens otherwise.
    base = np.asarray(jax.nn.log_softmax(
        jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray([tokens[:-1]], jnp.int32))[0], axis=-1))
    assert np.abs(np.asarray([base[i - 1, tokens[i]] for i in range(len(prompt), len(tokens))])
                  - np.asarray(expected)).max() > 1e-3
