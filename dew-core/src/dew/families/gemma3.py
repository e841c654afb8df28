"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Gemma 2's sandwich norms and scaled embeddings, plus an RMSNorm of each
query and key head (with Gemma's ``1 +`` offset); five sliding-window
layers to one global (``sliding_window_pattern`` 6, or the ``layer_types``
list); the sliding layers rotate with their own base
(``rope_local_base_freq``, 10 000) and no scaling, the global ones with
``rope_theta`` and any ``rope_scaling`` (linear, factor 8, in the 4B and
larger models). transformers' Gemma 3 applies no attention soft-capping
(whatever ``attn_logit_softcapping`` says), and neither does dew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import Family, builder
from dew.families.gemma import gated_gelu, gemma_parts
from dew.families.gemma2 import given
from dew.families.hf_config import (
    common_config,
    common_fields,
    layer_types,
    listed_window,
    number,
    refuse,
    rope_config,
    rope_fields,
    rope_parameters,
    sliding_layers,
    window_fields,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "Gemma3ForCausalLM"


def _ropes(config: Mapping[str, Any]) -> dict[str, Any]:
    """Global and local rotary settings, as transformers 5 reads either config layout."""
    full, _ = rope_parameters(config, "full_attention")
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local, _ = rope_parameters(config, "sliding_attention")
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    out = rope_fields(config, ARCHITECTURE, full, "rope_parameters.full_attention", theta=1_000_000.0)
    local_fields = rope_fields(config, ARCHITECTURE, local, "rope_parameters.sliding_attention",
                               theta=10_000.0)
    if local_fields["rope_scaling"] is not None:
        raise refuse(ARCHITECTURE, "rope_parameters.sliding_attention", local,
                     "its sliding layers rotate with the default rope of their own base only")
    return {**out, "local_rope_base": local_fields["rope_base"]}


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    if config.get("use_bidirectional_attention"):
        raise refuse(ARCHITECTURE, "use_bidirectional_attention", True,
                     "its decoder is causal (bidirectional Gemma 3 is an encoder)")
    fields = common_fields(config, tie_default=True)
    count = fields["num_layers"]
    listed = sliding_layers(config.get("layer_types"))
    if listed is None:
        pattern = int(config.get("sliding_window_pattern", 6))
        listed = tuple(i for i in range(count) if (i + 1) % pattern)
    return {**fields, **gemma_parts(config), **_ropes(config),
            **gated_gelu(config, ARCHITECTURE, "hidden_activation", ("gelu_pytorch_tanh",)),
            **window_fields(given(config, "sliding_window", 4096), listed, count),
            "norm_placement": "sandwich", "qk_norm": "head",
            "query_pre_attn_scalar": float(given(config, "query_pre_attn_scalar", 256)),
            "logit_softcap": (None if config.get("final_logit_softcapping") is None
                              else float(config["final_logit_softcapping"]))}


def write(model: Module) -> dict[str, Any]:
    local = model.rope_base if model.local_rope_base is None else model.local_rope_base
    full = rope_config(model.rope_base, model.rope_scaling)
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    types = layer_types(model)
    out = {**common_config(model, ARCHITECTURE, "gemma3_text"),
           "hidden_activation": "gelu_pytorch_tanh", "attention_bias": bool(model.qkv_bias),
           "rope_theta": float(model.rope_base), "rope_local_base_freq": float(local),
           "rope_scaling": None if model.rope_scaling is None else scaling,
           "rope_parameters": {"full_attention": full, "sliding_attention": rope_config(local, None)},
           "sliding_window": listed_window(model), "layer_types": types,
           "query_pre_attn_scalar": number(model.query_pre_attn_scalar),
           "final_logit_softcapping": model.logit_softcap, "attn_logit_softcapping": None,
           "use_bidirectional_attention": False}
    for pattern in range(1, model.num_layers + 2):  # transformers 4 reads a period, not the list
        if types == ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(model.num_layers)]:
            out["sliding_window_pattern"] = pattern
            break
    return out


_GEMMA3 = {"rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
           "tie_word_embeddings": True, "final_logit_softcapping": None}
_LINEAR8 = {"rope_type": "linear", "factor": 8.0}

PRESETS = {
    "1b": {**_GEMMA3, "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
           "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
           "max_position_embeddings": 32768},
    "270m": {**_GEMMA3, "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
             "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
             "max_position_embeddings": 32768},
    "4b-text": {**_GEMMA3, "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
                "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
                "max_position_embeddings": 131072, "rope_scaling": _LINEAR8},
    "12b-text": {**_GEMMA3, "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
                 "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
                 "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
                 "max_position_embeddings": 131072, "rope_scaling": _LINEAR8},
    "27b-text": {**_GEMMA3, "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
                 "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                 "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
                 "max_position_embeddings": 131072, "rope_scaling": _LINEAR8},
    "tiny": {**_GEMMA3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
             "sliding_window_pattern": 2, "max_position_embeddings": 256},
}

FAMILY = Family(
    name="gemma3", architecture=ARCHITECTURE, model_type="gemma3_text", read=read, write=write,
    presets=PRESETS,
    checkpoints="Gemma 3 text-only checkpoints (270M, 1B; Gemma3ForCausalLM). The 4B-27B models "
                "ship as Gemma3ForConditionalGeneration (vision + text); their text presets are "
                "here config-only, their directories are not read",
    defaults={"head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
)

build = builder("gemma3")
