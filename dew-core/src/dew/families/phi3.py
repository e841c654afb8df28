"""Phi-3 (``Phi3ForCausalLM``): Llama's function with fused projections.

Queries, keys and values are one tensor (``qkv_proj``, rows in that order)
and the feed-forward gate and up projections another (``gate_up_proj``,
gate first); dew splits them on load and joins them on save, so the round
trip stays bitwise. ``partial_rotary_factor`` rotates only the first share
of each head (Phi-4-mini); ``sliding_window`` applies to every layer
(2047 in Phi-3-mini-4k). LongRoPE (the 128k checkpoints, Phi-3.5-mini,
Phi-4-mini; ``su`` and ``yarn`` in older configs, which transformers reads
as LongRoPE too) divides each frequency by its own factor, from
``short_factor`` within ``original_max_position_embeddings`` and from
``long_factor`` past it (dew.nn.rotary).
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
    window_fields,
)
from dew.families.llama import gated_silu

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "Phi3ForCausalLM"


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind in ("su", "yarn", "longrope"):  # transformers reads Phi-3's "su" and "yarn" as LongRoPE
        params = {**params, "rope_type": "longrope", "type": "longrope"}
    elif kind != "default":
        raise refuse(ARCHITECTURE, f"{where}.rope_type", kind, "Phi-3's rope types are 'default' and LongRoPE")
    fields = common_fields(config)
    rope = rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0, partial=True)
    scaling = rope["rope_scaling"]
    if scaling is not None:
        head = fields["head_features"] or fields["emb_features"] // fields["num_heads"]
        pairs = int(head * rope["rotary_fraction"]) // 2
        if len(scaling.short_factor) != pairs:
            raise refuse(ARCHITECTURE, f"{where}.short_factor", f"{len(scaling.short_factor)} numbers",
                         f"LongRoPE gives one factor per rotated feature pair, {pairs} here")
    return {**fields, **gated_silu(config, ARCHITECTURE), **rope,
            **window_fields(config.get("sliding_window"), None, fields["num_layers"])}


def write(model: Module) -> dict[str, Any]:
    windows = {window for window, _, _ in model._layer_parts()}
    window = next(iter(windows)) if len(windows) == 1 else model.sliding_window
    scaling = model.rope_scaling
    original = model.max_seq_len if scaling is None else scaling.original_max_len
    return {**common_config(model, ARCHITECTURE, "phi3"), **flat_rope_config(model),
            "partial_rotary_factor": float(model.rotary_fraction), "hidden_act": "silu",
            "sliding_window": window, "original_max_position_embeddings": original,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0}


PRESETS: dict[str, dict[str, Any]] = {
    "mini-4k": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "sliding_window": 2047,
                "tie_word_embeddings": False},
    "medium-4k": {"vocab_size": 32064, "hidden_size": 5120, "intermediate_size": 17920,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
                  "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "sliding_window": 2047,
                  "tie_word_embeddings": False},
    "phi-4": {"vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920,
              "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
              "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
              "rms_norm_eps": 1e-5, "rope_theta": 250_000.0, "sliding_window": None,
              "tie_word_embeddings": False},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "original_max_position_embeddings": 256, "rms_norm_eps": 1e-5,
             "rope_theta": 10_000.0, "partial_rotary_factor": 0.5, "sliding_window": 8,
             "tie_word_embeddings": False},
}

FAMILY = Family(
    name="phi3", architecture=ARCHITECTURE, model_type="phi3", read=read, write=write,
    presets=PRESETS, fused=True,
    checkpoints="Phi-3-mini-4k, Phi-3-medium-4k, Phi-4 (14B) and other Phi3ForCausalLM checkpoints "
                "with default rope or LongRoPE (the 128k variants, Phi-3.5-mini, Phi-4-mini); partial "
                "rotary included",
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
)

build = builder("phi3")
