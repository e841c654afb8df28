"""LoRA on DeepSeek's latent attention: decoded, and exported for PEFT.

The cached decode path multiplies slices of the key/value up-projection (the absorbed form of
multi-head latent attention), which qwix's LoRA einsum could not match to the adapted weight:
every sample of a DeepSeek run with attention adapters, its closing preview and `dew generate`
stopped with an einsum error. Decoded, the adapted model must give each new token the
log-probability a full forward pass of the same adapted model gives it. Its adapters export for
PEFT: the compressed projections (``kv_a_proj_with_mqa``, ``q_a_proj``, ...) were refused as if they
were routers or experts, since the writer knew Linears only by a ``_proj`` suffix.
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

SPEC = Lora(rank=2, alpha=4.0, targets=("attention",))


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint (every weight redrawn), and its model with attention adapters."""
    directory = write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek"), seed=2, redrawn=True)
    loaded = Pretrained.load(directory)
    assert loaded.model.attention_block == "latent"
    return directory, loaded, *drawn_adapters(loaded.model, loaded.variables, SPEC, scale=0.3)


def test_decoding_an_adapted_latent_attention_scores_as_its_full_forward_pass(adapted):
    _, loaded, adapted, variables = adapted
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


def test_the_adapters_of_latent_attention_export_for_peft(adapted, tmp_path):
    import torch
    import transformers
    from peft import PeftModel

    from dew.pretrained.peft import save_adapters

    directory, loaded, model, variables = adapted
    save_adapters(tmp_path / "adapters", loaded.model, variables, SPEC, base_name=str(directory))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    theirs = PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
    ids = [[5, 6, 7, 8, 9, 10, 11]]
    with torch.no_grad():
        expected = theirs(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - expected).max() <= 1e-4


def test_a_weight_stored_in_another_order_is_not_given_to_peft():
    """PEFT's A and B compute the change dew's make only where the family stores the weight
    transposed and reshaped; rows in another order would need the adapters reordered too."""
    from dew.families.convert import Entry, TensorLayout, heads_in, transposed
    from dew.pretrained.peft import _plain

    def entry(name, layout, dew_shape, hf_shape):
        return Entry(name, (("layers_0", "attention", "query"),), hf_shape, (dew_shape,), layout)

    assert _plain(entry("a.0.x.weight", transposed(), (6, 4), (4, 6)))
    assert _plain(entry("a.0.y.weight", heads_in(6, 2, 3), (6, 2, 3), (6, 6)))
    flipped = TensorLayout(lambda arrays: arrays[0].T[::-1], lambda array: (array[::-1].T,))
    assert not _plain(entry("a.0.z.weight", flipped, (6, 4), (4, 6)))
