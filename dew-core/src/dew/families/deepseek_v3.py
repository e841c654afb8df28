"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): latent attention and group-limited routed experts.

Attention is multi-head latent attention (dew.nn.latent_attention): queries
through a ``q_lora_rank`` latent (or directly), keys and values from one
``kv_lora_rank`` latent, a decoupled rotary part of ``qk_rope_head_dim``
features stored as interleaved pairs (``rope_interleave``), YaRN frequencies
and their mscale in long-context checkpoints. The first
``first_k_dense_replace`` layers have a dense SwiGLU block of
``intermediate_size``; the others route each token to
``num_experts_per_tok`` of ``n_routed_experts`` experts by sigmoid scores,
choosing among the best ``topk_group`` of ``n_group`` groups with the
score-correction bias, gates renormalized (``norm_topk_prob``) and scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` shared experts
(dew.nn.experts.RoutedExperts, dropless). The multi-token-prediction layer
of the published checkpoints (``num_nextn_predict_layers``) is not part of
the model transformers or dew computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import builder
from dew.families.hf_config import (
    common_config,
    common_fields,
    flat_rope_config,
    refuse,
    rope_fields,
    rope_parameters,
)
from dew.families.llama import gated_silu
from dew.families.routed import ExpertNames, RoutedFamily
from dew.nn.experts import Routing
from dew.nn.latent_attention import Latent

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "DeepseekV3ForCausalLM"


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    fields = common_fields(config)
    heads = fields["num_heads"]
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise refuse(ARCHITECTURE, "num_key_value_heads", kv_heads,
                     f"latent attention gives each of its num_attention_heads={heads} heads its own key")
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise refuse(ARCHITECTURE, "scoring_func", scoring, "DeepSeek-V3's router scores by sigmoid")
    moe = int(config.get("moe_intermediate_size", 2048))
    q_rank = config.get("q_lora_rank")
    latent = Latent(kv_lora_rank=int(config.get("kv_lora_rank", 512)),
                    qk_nope_head_features=int(config.get("qk_nope_head_dim", 128)),
                    qk_rope_head_features=int(config.get("qk_rope_head_dim", 64)),
                    v_head_features=int(config.get("v_head_dim", 128)),
                    q_lora_rank=None if q_rank is None else int(q_rank),
                    interleave=bool(config.get("rope_interleave", True)))
    routing = Routing(hidden_features=moe, scoring="sigmoid",
                      normalize_top_k=bool(config.get("norm_topk_prob", True)),
                      routed_scale=float(config.get("routed_scaling_factor", 2.5)),
                      groups=int(config.get("n_group") or 1), groups_per_token=int(config.get("topk_group") or 1),
                      score_correction=True, shared_features=moe * int(config.get("n_shared_experts") or 0))
    rope = rope_fields(config, ARCHITECTURE, params, where, theta=10_000.0)  # all of qk_rope_head_dim rotates
    bias = bool(config.get("attention_bias", False))
    return {**fields, "num_kv_heads": None, "head_features": None, **gated_silu(config, ARCHITECTURE),
            **rope, "attention_block": "latent", "latent": latent, "qkv_bias": bias,
            "mlp_block": "routed", "experts": int(config.get("n_routed_experts", 256)),
            "experts_per_token": int(config.get("num_experts_per_tok", 8)), "routing": routing,
            "dense_layers": tuple(range(min(int(config.get("first_k_dense_replace") or 0), fields["num_layers"])))}


def write(model: Module) -> dict[str, Any]:
    latent, routing = model.latent, model.routing
    if latent is None or routing is None:
        raise refuse(ARCHITECTURE, "attention_block/mlp_block", (model.attention_block, model.mlp_block),
                     "DeepSeek-V3 has latent attention and routed experts")
    moe = routing.hidden_features or model.mlp_features
    return {**common_config(model, ARCHITECTURE, "deepseek_v3"), **flat_rope_config(model),
            "num_key_value_heads": model.num_heads, "head_dim": latent.qk_rope_head_features,
            "hidden_act": "silu", "attention_bias": bool(model.qkv_bias),
            "kv_lora_rank": latent.kv_lora_rank, "q_lora_rank": latent.q_lora_rank,
            "qk_nope_head_dim": latent.qk_nope_head_features, "qk_rope_head_dim": latent.qk_rope_head_features,
            "v_head_dim": latent.v_head_features, "rope_interleave": bool(latent.interleave),
            "n_routed_experts": model.experts, "num_experts_per_tok": model.experts_per_token,
            "moe_intermediate_size": moe, "n_shared_experts": routing.shared_features // moe,
            "n_group": routing.groups, "topk_group": routing.groups_per_token,
            "norm_topk_prob": bool(routing.normalize_top_k), "routed_scaling_factor": routing.routed_scale,
            "first_k_dense_replace": len(set(model.dense_layers)), "num_nextn_predict_layers": 0}


PRESETS = {
    "671b": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
             "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
             "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
             "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
             "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
             "rope_theta": 10_000.0, "tie_word_embeddings": False, "rope_interleave": True,
             "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
             "n_shared_experts": 2, "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16,
             "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 8,
             "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "first_k_dense_replace": 1,
             "norm_topk_prob": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
             "rope_theta": 10_000.0, "tie_word_embeddings": False, "rope_interleave": True,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}},
}

def unread(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The multi-token-prediction layers (``num_nextn_predict_layers`` of them, numbered after the
    model's last layer): the published checkpoints hold them, the model does not compute them. With
    ``n_shared_experts`` 0, the shared experts transformers stores anyway, with no elements."""
    layers = int(config.get("num_hidden_layers") or 0)
    extra = int(config.get("num_nextn_predict_layers") or 0)
    empty = () if config.get("n_shared_experts", 1) else tuple(
        f"model.layers.{i}.mlp.shared_experts." for i in range(layers))
    return (*(f"model.layers.{layers + i}." for i in range(extra)), *empty)


FAMILY = RoutedFamily(
    name="deepseek_v3", architecture=ARCHITECTURE, model_type="deepseek_v3", read=read, write=write,
    presets=PRESETS, names=ExpertNames(shared="shared_experts"), unread=unread,
    checkpoints="DeepSeek-V3 and V3-0324, DeepSeek-R1 and R1-0528 (671B; the multi-token-prediction "
                "layer is left unread, as transformers leaves it), and other DeepseekV3ForCausalLM checkpoints",
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "n_routed_experts": 256,
              "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "norm_topk_prob": True,
              "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "n_shared_experts": 1,
              "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "rope_interleave": True},
)

build = builder("deepseek_v3")
