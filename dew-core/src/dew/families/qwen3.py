"""Qwen 3 (``Qwen3ForCausalLM``): Llama's layer with an RMSNorm of each query and key head.

The q/k norms run over one head's width, after the projection and before
the rotation. ``attention_bias`` (false in published checkpoints) puts a
bias on q/k/v/o. The sliding-window settings are Qwen 2's.
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
from dew.families.qwen2 import qwen_window_config, qwen_windows

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "Qwen3ForCausalLM"


def layer_fields(config: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen 3's layer read from config (Qwen 3 MoE's attention too)."""
    params, where = rope_parameters(config)
    fields = common_fields(config)
    bias = bool(config.get("attention_bias", False))
    return {**fields, **gated_silu(config, architecture),
            **rope_fields(config, architecture, params, where, theta=10_000.0),
            **qwen_windows(config, fields["num_layers"]), "qk_norm": "head", "qkv_bias": bias,
            "out_bias": bias}


def layer_config(model: Module, architecture: str, model_type: str) -> dict[str, Any]:
    """Qwen 3's layer as config.json fields."""
    return {**common_config(model, architecture, model_type), **flat_rope_config(model),
            **qwen_window_config(model), "hidden_act": "silu", "attention_bias": bool(model.qkv_bias)}


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    return layer_fields(config, ARCHITECTURE)


def write(model: Module) -> dict[str, Any]:
    return layer_config(model, ARCHITECTURE, "qwen3")


_QWEN3 = {"vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
          "rope_theta": 1_000_000.0, "head_dim": 128, "num_key_value_heads": 8,
          "use_sliding_window": False}

PRESETS = {
    "0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "tie_word_embeddings": True},
    "1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
             "num_attention_heads": 16, "tie_word_embeddings": True},
    "4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
           "num_attention_heads": 32, "tie_word_embeddings": True},
    "8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "tie_word_embeddings": False},
    "14b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
            "num_attention_heads": 40, "tie_word_embeddings": False},
    "32b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
            "num_attention_heads": 64, "tie_word_embeddings": False},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
             "tie_word_embeddings": True},
}

FAMILY = Family(
    name="qwen3", architecture=ARCHITECTURE, model_type="qwen3", read=read, write=write,
    presets=PRESETS,
    checkpoints="Qwen 3 dense models (0.6B to 32B, base and instruct/thinking, the 2507 updates)",
    defaults={"num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "sliding_window": 4096,
              "max_window_layers": 28},
)

build = builder("qwen3")
