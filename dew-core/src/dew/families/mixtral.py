"""Mixtral (``MixtralForCausalLM``): Mistral's layer with a routed mixture of SwiGLU experts.

Every layer's feed-forward block is ``num_local_experts`` experts of width
``intermediate_size``; a softmax router picks ``num_experts_per_tok`` of them
per token and their probabilities, renormalized to sum to one, weigh them
(dew.nn.experts.RoutedExperts, dropless). ``router_jitter_noise`` perturbs
transformers' training inputs only and changes nothing the model computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.families.base import builder
from dew.families.mistral import layer_config, layer_fields
from dew.families.routed import ExpertNames, RoutedFamily
from dew.nn.experts import Routing

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flax.linen import Module

__all__ = ["FAMILY"]

ARCHITECTURE = "MixtralForCausalLM"


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**layer_fields(config, ARCHITECTURE, theta=1_000_000.0), "mlp_block": "routed", "experts": int(config.get("num_local_experts", 8)),
            "experts_per_token": int(config.get("num_experts_per_tok", 2)), "routing": Routing()}


def write(model: Module) -> dict[str, Any]:
    return {**layer_config(model, ARCHITECTURE, "mixtral"), "num_local_experts": model.experts,
            "num_experts_per_tok": model.experts_per_token, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": 0.02, "output_router_logits": False}


_MIXTRAL = {"num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
            "rope_theta": 1_000_000.0, "num_local_experts": 8, "num_experts_per_tok": 2,
            "sliding_window": None, "tie_word_embeddings": False}

PRESETS: dict[str, dict[str, Any]] = {
    "8x7b": {**_MIXTRAL, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "max_position_embeddings": 32768},
    "8x22b": {**_MIXTRAL, "vocab_size": 32768, "hidden_size": 6144, "intermediate_size": 16384,
              "num_hidden_layers": 56, "num_attention_heads": 48, "max_position_embeddings": 65536},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "sliding_window": 8,
             "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
}

FAMILY = RoutedFamily(
    name="mixtral", architecture=ARCHITECTURE, model_type="mixtral", read=read, write=write,
    presets=PRESETS, names=ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
    checkpoints="Mixtral 8x7B and 8x22B (base and instruct, v0.1)",
    defaults={"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "sliding_window": None},
)

build = builder("mixtral")
