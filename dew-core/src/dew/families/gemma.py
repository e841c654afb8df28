"""Gemma (``GemmaForCausalLM``): Llama's layout with Gemma's conventions.

Every RMSNorm scale is stored as an offset from one (the norm multiplies by
``1 + w``); the embeddings are multiplied by ``sqrt(hidden_size)`` (rounded
to the compute dtype, as transformers does); the feed-forward gate is GELU
with the tanh approximation (Gemma's config says ``gelu``, which
transformers reads as ``gelu_pytorch_tanh``); the head is tied by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import Family, builder
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    refuse,
    rope_fields,
    rope_parameters,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY", "gated_gelu"]

ARCHITECTURE = "GemmaForCausalLM"


def gated_gelu(config: Mapping[str, Any], architecture: str, key: str, accepted: tuple[str, ...]) -> dict[str, Any]:
    """GeGLU with tanh-approximated GELU, from config's activation key; refuse another."""
    act = config.get(key) or "gelu_pytorch_tanh"
    if act not in accepted:
        raise refuse(architecture, key, act,
                     f"its feed-forward gate is tanh-approximated GELU ({', '.join(accepted)})")
    return {"mlp_activation": "geglu"}


def gemma_parts(config: Mapping[str, Any]) -> dict[str, Any]:
    """What every Gemma shares: the ``1 +`` norms, scaled embeddings, biases when asked."""
    bias = bool(config.get("attention_bias", False))
    return {"norm_offset": True, "scale_embeddings": True, "qkv_bias": bias, "out_bias": bias}


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    return {**common_fields(config, tie_default=True),
            **gated_gelu(config, ARCHITECTURE, "hidden_act", ("gelu", "gelu_pytorch_tanh")),
            **rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0), **gemma_parts(config)}


def write(model: Module) -> dict[str, Any]:
    return {**common_config(model, ARCHITECTURE, "gemma"), **flat_rope_config(model),
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": bool(model.qkv_bias)}


PRESETS = {
    "2b": {"vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384,
           "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
           "hidden_act": "gelu", "tie_word_embeddings": True},
    "7b": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
           "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
           "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
           "rope_theta": 10_000.0, "hidden_act": "gelu", "tie_word_embeddings": True},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
             "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}

FAMILY = Family(
    name="gemma", architecture=ARCHITECTURE, model_type="gemma", read=read, write=write,
    presets=PRESETS,
    checkpoints="Gemma 1 and 1.1 (2B, 7B, base and instruct), CodeGemma",
    defaults={"head_dim": 256, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192},
)

build = builder("gemma")
