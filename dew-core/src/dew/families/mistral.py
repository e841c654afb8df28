"""Mistral (``MistralForCausalLM``): Llama's layer with an optional sliding window.

Mistral 7B v0.1 lets each position see the 4096 before it (itself
included); later Mistral checkpoints set ``sliding_window`` to null and are
Llama's function exactly. A ``layer_types`` list (Ministral 8B) windows only
the layers it marks ``sliding_attention``, as transformers reads it (its
AutoConfig loads such a directory as Ministral). No biases; SwiGLU;
``head_dim`` may differ from hidden/heads (Mistral Nemo).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import Family, builder
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    layer_types,
    one_window,
    rope_fields,
    rope_parameters,
    sliding_layers,
    window_fields,
)
from dew.families.llama import gated_silu

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "MistralForCausalLM"


def layer_fields(config: Mapping[str, Any], architecture: str, theta: float,
                 listed: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Mistral's layer read from config (Mixtral's too, whose rope base defaults higher); listed
    names the layers the window applies to (None: every layer)."""
    params, where = rope_parameters(config)
    fields = common_fields(config)
    return {**fields, **gated_silu(config, architecture),
            **rope_fields(config, architecture, params, where, theta=theta),
            **window_fields(config.get("sliding_window"), listed, fields["num_layers"])}


def layer_config(model: Module, architecture: str, model_type: str) -> dict[str, Any]:
    """Mistral's layer as config.json fields: one window for every layer, or none."""
    return {**common_config(model, architecture, model_type), **flat_rope_config(model),
            "hidden_act": "silu", "sliding_window": one_window(model)}


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    return layer_fields(config, ARCHITECTURE, theta=10_000.0, listed=sliding_layers(config.get("layer_types")))


def write(model: Module) -> dict[str, Any]:
    """One window on every layer as Mistral writes it; a window on some layers as layer_types."""
    written = layer_config(model, ARCHITECTURE, "mistral")
    types = layer_types(model)
    if len(set(types)) > 1:
        written.update(sliding_window=model.sliding_window, layer_types=types)
    return written


_MISTRAL = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False}

PRESETS: dict[str, dict[str, Any]] = {
    "7b-v0.1": {**_MISTRAL, "vocab_size": 32000, "max_position_embeddings": 32768,
                "rope_theta": 10_000.0, "sliding_window": 4096},
    "7b-v0.3": {**_MISTRAL, "vocab_size": 32768, "max_position_embeddings": 32768,
                "rope_theta": 1_000_000.0, "sliding_window": None},
    "nemo-12b": {**_MISTRAL, "vocab_size": 131072, "hidden_size": 5120, "num_hidden_layers": 40,
                 "head_dim": 128, "max_position_embeddings": 1024000, "rope_theta": 1_000_000.0,
                 "sliding_window": None},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "sliding_window": 8,
             "tie_word_embeddings": False},
}

FAMILY = Family(
    name="mistral", architecture=ARCHITECTURE, model_type="mistral", read=read, write=write,
    presets=PRESETS,
    checkpoints="Mistral 7B v0.1 to v0.3 (base and instruct), Mistral Nemo 12B, Mistral Small "
                "(MistralForCausalLM text checkpoints)",
    defaults={"num_key_value_heads": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "sliding_window": 4096},
)

build = builder("mistral")
