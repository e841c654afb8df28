"""Qwen 2 and 2.5 (``Qwen2ForCausalLM``): Llama's layer with biases on the q/k/v projections.

The output projection has no bias. A sliding window, when
``use_sliding_window`` is set, applies to the layers from
``max_window_layers`` on (transformers 5 writes the per-layer list,
``layer_types``, which wins when present). Long-context Qwen 2.5
checkpoints rescale rotary frequencies with YaRN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import Family, builder
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    layer_types,
    rope_fields,
    rope_parameters,
    sliding_layers,
    window_fields,
)
from dew.families.llama import gated_silu

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY", "qwen_windows", "qwen_window_config"]

ARCHITECTURE = "Qwen2ForCausalLM"


def qwen_windows(config: Mapping[str, Any], count: int) -> dict[str, Any]:
    """Qwen's sliding window: on layers max_window_layers.. when use_sliding_window, or as listed."""
    if not config.get("use_sliding_window", False):
        return window_fields(None, None, count)
    window = config.get("sliding_window")
    listed = sliding_layers(config.get("layer_types"))
    if listed is None:
        start = int(config.get("max_window_layers", count))
        listed = tuple(range(start, count))
    return window_fields(window, listed, count)


def qwen_window_config(model: Module) -> dict[str, Any]:
    """use_sliding_window, sliding_window, max_window_layers and layer_types for model."""
    types = layer_types(model)
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    out: dict[str, Any] = {"use_sliding_window": bool(sliding),
                           "sliding_window": model.sliding_window if sliding else None,
                           "max_window_layers": sliding[0] if sliding else model.num_layers,
                           "layer_types": types}
    return out


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    fields = common_fields(config)
    return {**fields, **gated_silu(config, ARCHITECTURE),
            **rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0),
            **qwen_windows(config, fields["num_layers"]), "qkv_bias": True}


def write(model: Module) -> dict[str, Any]:
    return {**common_config(model, ARCHITECTURE, "qwen2"), **flat_rope_config(model),
            **qwen_window_config(model), "hidden_act": "silu"}


_QWEN25 = {"vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "rope_theta": 1_000_000.0, "use_sliding_window": False}

PRESETS = {
    "2.5-0.5b": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                 "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "2.5-1.5b": {**_QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                 "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "2.5-3b": {**_QWEN25, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
               "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "2.5-7b": {**_QWEN25, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
               "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
               "tie_word_embeddings": False},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "use_sliding_window": True,
             "sliding_window": 8, "max_window_layers": 1, "tie_word_embeddings": True},
}

FAMILY = Family(
    name="qwen2", architecture=ARCHITECTURE, model_type="qwen2", read=read, write=write,
    presets=PRESETS,
    checkpoints="Qwen 2 and Qwen 2.5 (0.5B to 72B, base, instruct, Coder, Math), "
                "DeepSeek-R1-Distill-Qwen; YaRN long-context settings included",
    defaults={"num_key_value_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "sliding_window": 4096,
              "max_window_layers": 28},
)

build = builder("qwen2")
