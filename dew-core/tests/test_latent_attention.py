"""LatentAttention against transformers' DeepseekV3Attention, and its decode cache against
the whole-sequence pass.

transformers' attention is built tiny in float32 with every weight redrawn (latent norm
scales and biases far from their defaults), and called with its own rotary embedding
and a causal mask; dew's takes the same weights, inputs and positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dew.nn.latent_attention import LatentAttention
from dew.nn.rotary import RopeScaling

FEATURES, HEADS, KV_RANK, NOPE, ROPE, VALUE = 16, 2, 8, 4, 6, 5
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 8, "beta_slow": 1}
CASES = {
    "direct queries": {"q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
                       "attention_bias": False, "rope_interleave": True},
    "compressed queries, yarn, biases": {"q_lora_rank": 6, "rope_parameters": YARN, "attention_bias": True,
                                         "rope_interleave": False},
}


def build(case: str) -> tuple[torch.nn.Module, torch.nn.Module, LatentAttention, dict]:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    options = CASES[case]
    config = DeepseekV3Config(hidden_size=FEATURES, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                              v_head_dim=VALUE, max_position_embeddings=64, **options)
    config._attn_implementation = "eager"
    attention = DeepseekV3Attention(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(len(case))
    with torch.no_grad():
        for tensor in attention.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.4
                         + (1.0 if tensor.ndim == 1 else 0.0))  # norm scales and biases near 1, not 0 or 1

    def linear(module: torch.nn.Module, *shape: int) -> np.ndarray:
        return module.weight.detach().numpy().T.reshape(*shape)

    params = {"kv_down": linear(attention.kv_a_proj_with_mqa, FEATURES, KV_RANK + ROPE),
              "kv_norm": attention.kv_a_layernorm.weight.detach().numpy(),
              "kv_up": linear(attention.kv_b_proj, KV_RANK, HEADS, NOPE + VALUE),
              "out": linear(attention.o_proj, HEADS, VALUE, FEATURES)}
    rank = options["q_lora_rank"]
    if rank is None:
        params["query"] = linear(attention.q_proj, FEATURES, HEADS, NOPE + ROPE)
    else:
        params.update(query_down=linear(attention.q_a_proj, FEATURES, rank),
                      query_norm=attention.q_a_layernorm.weight.detach().numpy(),
                      query_up=linear(attention.q_b_proj, rank, HEADS, NOPE + ROPE))
    if options["attention_bias"]:
        params.update(kv_down_bias=attention.kv_a_proj_with_mqa.bias.detach().numpy(),
                      out_bias=attention.o_proj.bias.detach().numpy())
        if rank is not None:
            params["query_down_bias"] = attention.q_a_proj.bias.detach().numpy()
    rope = options["rope_parameters"]
    yarn = None if rope["rope_type"] == "default" else RopeScaling(
        "yarn", rope["factor"], original_max_len=rope["original_max_position_embeddings"],
        beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope["mscale"],
        mscale_all_dim=rope["mscale_all_dim"])
    dew = LatentAttention(HEADS, max_len=32, kv_lora_rank=KV_RANK, q_lora_rank=rank, qk_nope_head_features=NOPE,
                          qk_rope_head_features=ROPE, v_head_features=VALUE, rope_base=rope["rope_theta"],
                          rope_scaling=yarn, rope_interleave=options["rope_interleave"],
                          attention_bias=options["attention_bias"])
    return attention, DeepseekV3RotaryEmbedding(config), dew, {"params": jax.tree.map(jnp.asarray, params)}


def inputs(length: int = 7) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(5).normal(size=(2, length, FEATURES)).astype(np.float32)
    positions = np.stack([np.arange(length), np.arange(length) + 9]).astype(np.int32)  # one row offset
    return x, positions


@pytest.mark.parametrize("case", list(CASES))
def test_latent_attention_computes_what_transformers_computes(case):
    attention, rotary, dew, variables = build(case)
    x, positions = inputs()
    hidden, where = torch.from_numpy(x), torch.from_numpy(positions).long()
    length = x.shape[1]
    mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        expected, _ = attention(hidden_states=hidden, position_embeddings=rotary(hidden, where),
                                attention_mask=mask)
    # Every weight has its counterpart.
    shapes = jax.eval_shape(dew.init, jax.random.key(0), x, positions)
    assert jax.tree.map(jnp.shape, jax.tree.map(lambda b: b.unbox(), shapes, is_leaf=lambda b: hasattr(b, "unbox"))) \
        == jax.tree.map(jnp.shape, variables)
    got = jax.jit(dew.apply)(variables, x, positions)
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_the_latent_cache_decodes_what_the_whole_sequence_computes():
    _, _, dew, variables = build("compressed queries, yarn, biases")
    x, _ = inputs(6)
    positions = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))  # a cache slot per position
    whole = jax.jit(dew.apply)(variables, x, positions)
    step = jax.jit(lambda v, x, p: dew.apply(v, x, p, decode=True, mutable=["cache"]))
    out, cache = step(variables, x[:, :3], positions[:, :3])  # the prompt at once
    pieces = [out]
    for t in range(3, 6):  # then a token at a time
        out, cache = step({**variables, **cache}, x[:, t:t + 1], positions[:, t:t + 1])
        pieces.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(whole),
                               rtol=1e-5, atol=1e-5)
    assert cache["cache"]["cached_latent"].shape == (2, 32, KV_RANK)  # the latent, not per-head keys
