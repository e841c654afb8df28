"""Gemma 2 (``Gemma2ForCausalLM``): Gemma with sandwich norms, soft-capping and sliding layers.

Each block is wrapped in two norms, x + norm(block(norm(x))); attention
scores are bounded by ``50 * tanh(s / 50)`` and the logits by
``30 * tanh(l / 30)`` (``attn_logit_softcapping``,
``final_logit_softcapping``); scores scale by
``query_pre_attn_scalar ** -0.5`` instead of the head width's; layers
alternate a sliding window (even layers, from 0) with full attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import Family, builder
from dew.families.gemma import gated_gelu, gemma_parts
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    layer_types,
    listed_window,
    number,
    rope_fields,
    rope_parameters,
    sliding_layers,
    window_fields,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY", "given"]

ARCHITECTURE = "Gemma2ForCausalLM"


def given(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """config[key] when the key is there (null included), else transformers' default."""
    return config[key] if key in config else default


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    fields = common_fields(config, tie_default=True)
    count = fields["num_layers"]
    listed = sliding_layers(config.get("layer_types"))
    if listed is None:
        listed = tuple(i for i in range(count) if (i + 1) % 2)
    return {**fields, **gemma_parts(config),
            **gated_gelu(config, ARCHITECTURE, "hidden_activation", ("gelu_pytorch_tanh",)),
            **rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0),
            **window_fields(given(config, "sliding_window", 4096), listed, count),
            "norm_placement": "sandwich",
            "query_pre_attn_scalar": float(given(config, "query_pre_attn_scalar", 256)),
            "attention_softcap": _float(given(config, "attn_logit_softcapping", 50.0)),
            "logit_softcap": _float(given(config, "final_logit_softcapping", 30.0))}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def write(model: Module) -> dict[str, Any]:
    return {**common_config(model, ARCHITECTURE, "gemma2"), **flat_rope_config(model),
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": bool(model.qkv_bias), "sliding_window": listed_window(model),
            "layer_types": layer_types(model), "query_pre_attn_scalar": number(model.query_pre_attn_scalar),
            "attn_logit_softcapping": model.attention_softcap,
            "final_logit_softcapping": model.logit_softcap}


_GEMMA2 = {"vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
           "rope_theta": 10_000.0, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
           "tie_word_embeddings": True}

PRESETS = {
    "2b": {**_GEMMA2, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
           "query_pre_attn_scalar": 256},
    "9b": {**_GEMMA2, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
           "query_pre_attn_scalar": 256},
    "27b": {**_GEMMA2, "hidden_size": 4608, "intermediate_size": 36864, "num_hidden_layers": 46,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "query_pre_attn_scalar": 144},
    "tiny": {**_GEMMA2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "query_pre_attn_scalar": 16, "max_position_embeddings": 256,
             "sliding_window": 8},
}

FAMILY = Family(
    name="gemma2", architecture=ARCHITECTURE, model_type="gemma2", read=read, write=write,
    presets=PRESETS,
    checkpoints="Gemma 2 (2B, 9B, 27B, base and instruct), ShieldGemma 2B/9B",
    defaults={"head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192},
)

build = builder("gemma2")
