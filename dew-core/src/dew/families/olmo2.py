"""OLMo 2 (``Olmo2ForCausalLM``): norms after each block, and q/k norms over the whole projection.

A layer computes x + norm(attention(x)), then x + norm(mlp(x)), with no
norm before either block; the query and key norms run over all heads'
features together (one RMSNorm of width heads * head_dim), unlike Qwen 3's
per head. ``attention_bias`` puts a bias on q/k/v/o.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import Family, builder
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    rope_fields,
    rope_parameters,
)
from dew.families.llama import gated_silu

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "Olmo2ForCausalLM"


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    bias = bool(config.get("attention_bias", False))
    return {**common_fields(config), **gated_silu(config, ARCHITECTURE),
            **rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0),
            "norm_placement": "post", "qk_norm": "projection", "qkv_bias": bias, "out_bias": bias}


def write(model: Module) -> dict[str, Any]:
    return {**common_config(model, ARCHITECTURE, "olmo2"), **flat_rope_config(model),
            "hidden_act": "silu", "attention_bias": bool(model.qkv_bias)}


_OLMO2 = {"vocab_size": 100352, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
          "rope_theta": 500_000.0, "tie_word_embeddings": False}

PRESETS = {
    "1b": {**_OLMO2, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 16, "num_key_value_heads": 16},
    "7b": {**_OLMO2, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32},
    "13b": {**_OLMO2, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
            "num_attention_heads": 40, "num_key_value_heads": 40},
    "tiny": {**_OLMO2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256},
}

FAMILY = Family(
    name="olmo2", architecture=ARCHITECTURE, model_type="olmo2", read=read, write=write,
    presets=PRESETS,
    checkpoints="OLMo 2 (1B, 7B, 13B, 32B; base, SFT, DPO and Instruct)",
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
)

build = builder("olmo2")
