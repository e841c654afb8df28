"""Qwen 2 MoE (``Qwen2MoeForCausalLM``): Qwen 2's attention with routed experts and a gated shared one.

Each routed layer has ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``, a softmax router choosing ``num_experts_per_tok``
per token (their probabilities renormalized only when ``norm_topk_prob``),
and one shared expert of width ``shared_expert_intermediate_size`` whose
output a sigmoid gate scales (dew.nn.experts.RoutedExperts, dropless). A
layer is routed unless ``mlp_only_layers`` lists it or
``decoder_sparse_step`` skips it; those layers have a dense block of
``intermediate_size``. The q/k/v projections carry biases (``qkv_bias``).
With ``use_sliding_window`` and no ``layer_types``, transformers windows the
even-numbered layers below ``max_window_layers``; the export writes the
per-layer list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import builder
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    rope_fields,
    rope_parameters,
    sliding_layers,
    window_fields,
)
from dew.families.llama import gated_silu
from dew.families.qwen2 import qwen_window_config
from dew.families.routed import ExpertNames, RoutedFamily, dense_layers_of
from dew.nn.experts import Routing

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "Qwen2MoeForCausalLM"


def windows(config: Mapping[str, Any], count: int) -> dict[str, Any]:
    """The layers transformers' Qwen2MoeConfig windows: as listed, else even ones below max_window_layers."""
    if not config.get("use_sliding_window", False):
        return window_fields(None, None, count)
    listed = sliding_layers(config.get("layer_types"))
    if listed is None:
        below = int(config.get("max_window_layers", 28))
        listed = tuple(i for i in range(count) if i % 2 == 0 and i < below)
    return window_fields(config.get("sliding_window"), listed, count)


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    fields = common_fields(config)
    count = fields["num_layers"]
    experts = int(config.get("num_experts", 60))
    dense = dense_layers_of(config, count, experts)
    shared = int(config.get("shared_expert_intermediate_size", 5632))
    routing = Routing(hidden_features=int(config.get("moe_intermediate_size", 1408)),
                      normalize_top_k=bool(config.get("norm_topk_prob", False)),
                      shared_features=shared, shared_gate=shared > 0)
    return {**fields, **gated_silu(config, ARCHITECTURE),
            **rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0),
            **windows(config, count), "qkv_bias": bool(config.get("qkv_bias", True)),
            "mlp_block": "routed" if experts else "dense", "experts": experts,
            "experts_per_token": int(config.get("num_experts_per_tok", 4)),
            "routing": routing if experts else None, "dense_layers": dense if experts else ()}


def write(model: Module) -> dict[str, Any]:
    routing = model.routing or Routing()
    # The per-layer list (layer_types) wins over max_window_layers in transformers' reading.
    return {**common_config(model, ARCHITECTURE, "qwen2_moe"), **flat_rope_config(model),
            **qwen_window_config(model), "hidden_act": "silu", "qkv_bias": bool(model.qkv_bias),
            "num_experts": model.experts, "num_experts_per_tok": model.experts_per_token,
            "moe_intermediate_size": routing.hidden_features or model.mlp_features,
            "shared_expert_intermediate_size": routing.shared_features,
            "norm_topk_prob": bool(routing.normalize_top_k), "decoder_sparse_step": 1,
            "mlp_only_layers": sorted(set(model.dense_layers)), "router_aux_loss_coef": 0.001,
            "output_router_logits": False}


_QWEN2_MOE = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
              "norm_topk_prob": False, "use_sliding_window": False, "tie_word_embeddings": False}

PRESETS: dict[str, dict[str, Any]] = {
    "1.5-a2.7b": {**_QWEN2_MOE, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 8192,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "num_experts": 60, "num_experts_per_tok": 4},
    "57b-a14b": {**_QWEN2_MOE, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                 "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480,
                 "num_experts": 64, "num_experts_per_tok": 8},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
             "rope_theta": 1_000_000.0, "num_experts": 8, "num_experts_per_tok": 3,
             "norm_topk_prob": False, "mlp_only_layers": [1], "use_sliding_window": True,
             "sliding_window": 8, "max_window_layers": 2, "tie_word_embeddings": False},
}

def unread(config: Mapping[str, Any]) -> tuple[str, ...]:
    """With ``shared_expert_intermediate_size`` 0, the shared expert transformers stores anyway (no
    elements) and the gate of its output, which is zero: they compute nothing."""
    if config.get("shared_expert_intermediate_size", 5632):
        return ()
    return tuple(f"model.layers.{i}.mlp.shared_expert" for i in range(int(config.get("num_hidden_layers") or 0)))


FAMILY = RoutedFamily(
    name="qwen2_moe", architecture=ARCHITECTURE, model_type="qwen2_moe", read=read, write=write, unread=unread,
    presets=PRESETS, names=ExpertNames(shared="shared_expert", shared_gate="shared_expert_gate"),
    checkpoints="Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B (base and chat/instruct)",
    defaults={"num_key_value_heads": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "sliding_window": 4096,
              "max_window_layers": 28, "num_experts": 60, "num_experts_per_tok": 4,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "norm_topk_prob": False, "decoder_sparse_step": 1, "qkv_bias": True},
)

build = builder("qwen2_moe")
