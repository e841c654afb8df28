"""Llama (``LlamaForCausalLM``): pre-norm RMSNorm, SwiGLU, grouped-query attention, rotary.

dew's rotary pairs feature i with feature i + head_dim/2, which is Llama's
``rotate_half`` convention, so no permutation of the query and key columns
is needed; query head h reads key/value head ``h // (heads / kv_heads)`` in
both. Llama 3.1 and later rescale their rotary frequencies (``rope_type``
llama3), which dew computes as transformers does. ``attention_bias`` puts a
bias on q/k/v/o, ``mlp_bias`` on the three feed-forward matrices.
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

__all__ = ["FAMILY", "gated_silu"]

ARCHITECTURE = "LlamaForCausalLM"


def gated_silu(config: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The SwiGLU feed-forward block every Llama-like family uses; refuse another activation."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(architecture, "hidden_act", act, "its feed-forward gate is SiLU (SwiGLU)")
    return {"mlp_activation": "swiglu"}


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    bias = bool(config.get("attention_bias", False))
    return {**common_fields(config), **gated_silu(config, ARCHITECTURE),
            **rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0),
            "qkv_bias": bias, "out_bias": bias, "mlp_bias": bool(config.get("mlp_bias", False))}


def write(model: Module) -> dict[str, Any]:
    return {**common_config(model, ARCHITECTURE, "llama"), **flat_rope_config(model),
            "hidden_act": "silu", "attention_bias": bool(model.qkv_bias),
            "mlp_bias": bool(model.mlp_bias), "pretraining_tp": 1}


def _llama3(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


_LLAMA3 = {"vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
           "max_position_embeddings": 131072, "num_key_value_heads": 8}

PRESETS = {
    "3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "head_dim": 64, "tie_word_embeddings": True,
               "rope_scaling": _llama3(32.0)},
    "3.2-3b": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
               "num_attention_heads": 24, "head_dim": 128, "tie_word_embeddings": True,
               "rope_scaling": _llama3(32.0)},
    "3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "tie_word_embeddings": False, "rope_scaling": _llama3(8.0)},
    "3.1-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "tie_word_embeddings": False, "rope_scaling": _llama3(8.0)},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "tie_word_embeddings": True,
             "rope_scaling": {**_llama3(8.0), "original_max_position_embeddings": 64}},
}

FAMILY = Family(
    name="llama", architecture=ARCHITECTURE, model_type="llama", read=read, write=write,
    presets=PRESETS,
    checkpoints="Llama 2, Llama 3, 3.1, 3.2 (1B, 3B) and 3.3 text models; TinyLlama, SmolLM 1/2 and "
                "other LlamaForCausalLM checkpoints (attention_bias and mlp_bias included)",
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
)

build = builder("llama")
