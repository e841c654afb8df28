"""Qwen 3 MoE (``Qwen3MoeForCausalLM``): Qwen 3's attention with routed SwiGLU experts.

``num_experts`` experts of width ``moe_intermediate_size``, a softmax router
choosing ``num_experts_per_tok`` per token, their probabilities renormalized
only when ``norm_topk_prob`` (dew.nn.experts.RoutedExperts, dropless). A
layer is routed unless ``mlp_only_layers`` lists it or ``decoder_sparse_step``
skips it; those layers have a dense block of ``intermediate_size``
(dense_layers). The q/k norms are Qwen 3's. Its sliding window is not: with
``use_sliding_window`` set, every layer looks back ``sliding_window``
positions (transformers' Qwen3MoeConfig has no ``max_window_layers``), so a
model windowing only some of its layers has no exact counterpart here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import builder
from dew.families.hf_config import one_window, window_fields
from dew.families.qwen3 import layer_config, layer_fields
from dew.families.routed import ExpertNames, RoutedFamily, dense_layers_of
from dew.nn.experts import Routing

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "Qwen3MoeForCausalLM"


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    fields = layer_fields(config, ARCHITECTURE)
    count = fields["num_layers"]
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    fields.update(window_fields(window, None, count))  # every layer: no max_window_layers here
    experts = int(config.get("num_experts", config.get("num_local_experts", 128)))  # transformers 5 writes the latter
    dense = dense_layers_of(config, count, experts)
    routing = Routing(hidden_features=int(config.get("moe_intermediate_size", 768)),
                      normalize_top_k=bool(config.get("norm_topk_prob", False)))
    return {**fields, "mlp_block": "routed" if experts else "dense", "experts": experts,
            "experts_per_token": int(config.get("num_experts_per_tok", 8)),
            "routing": routing if experts else None, "dense_layers": dense if experts else ()}


def write(model: Module) -> dict[str, Any]:
    routing = model.routing or Routing()
    dense = {k: v for k, v in layer_config(model, ARCHITECTURE, "qwen3_moe").items()
             if k not in ("max_window_layers", "layer_types")}
    window = one_window(model)  # on every layer, or none
    return {**dense, "use_sliding_window": window is not None, "sliding_window": window, "num_experts": model.experts, "num_experts_per_tok": model.experts_per_token,
            "moe_intermediate_size": routing.hidden_features or model.mlp_features,
            "norm_topk_prob": bool(routing.normalize_top_k), "decoder_sparse_step": 1,
            "mlp_only_layers": sorted(set(model.dense_layers)), "router_aux_loss_coef": 0.001,
            "output_router_logits": False}


_QWEN3_MOE = {"vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
              "rope_theta": 1_000_000.0, "head_dim": 128, "num_key_value_heads": 4,
              "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
              "use_sliding_window": False, "tie_word_embeddings": False}

PRESETS: dict[str, dict[str, Any]] = {
    "30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_hidden_layers": 48, "num_attention_heads": 32},
    "235b-a22b": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288,
                  "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
             "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False, "mlp_only_layers": [1],
             "tie_word_embeddings": False},
}

FAMILY = RoutedFamily(
    name="qwen3_moe", architecture=ARCHITECTURE, model_type="qwen3_moe", read=read, write=write,
    presets=PRESETS, names=ExpertNames(),
    checkpoints="Qwen 3 MoE (30B-A3B, 235B-A22B; base, instruct and thinking, the 2507 updates) and "
                "Qwen3-Coder MoE text checkpoints",
    defaults={"num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "sliding_window": 4096,
              "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
              "decoder_sparse_step": 1},
)

build = builder("qwen3_moe")
