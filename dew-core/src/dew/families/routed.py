"""The converter table of the mixture-of-experts families, and the family type that uses it.

A routed layer's tensors, as transformers' checkpoints hold them (one
tensor per expert, as published), against dew's stacked ``[experts, ...]``
weights under ``layers_{i}/moe``: each expert's tensor is one slice of the
stack (``Entry.index``). The router is ``gate.weight`` [experts, embed]
(dew: ``router`` [embed, experts]); DeepSeek-V3 adds the score-correction
bias and shared experts, Qwen2-MoE a shared expert behind a sigmoid gate.
Latent attention (DeepSeek) replaces the q/k/v/o projections by its
compressed ones. Everything else (embeddings, norms, the head, the dense
feed-forward blocks of dense_layers) is the dense table's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dew.families.base import Family
from dew.families.convert import (
    Entry,
    TensorLayout,
    dense_table,
    heads_in,
    heads_out,
    same,
    transposed,
)

if TYPE_CHECKING:
    from flax.linen import Module

__all__ = ["ExpertNames", "RoutedFamily", "dense_layers_of", "routed_table"]

Path = tuple[str, ...]


@dataclass(frozen=True)
class ExpertNames:
    """How a family names a routed layer's tensors under ``model.layers.{i}``.

    block holds the router (``{block}.gate``) and the experts
    (``{block}.experts.{j}.{gate|up|down}``); shared is the shared experts'
    module (None: none); shared_gate the sigmoid gate's (Qwen2-MoE).
    """

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str | None = None
    shared_gate: str | None = None


def dense_layers_of(config: Mapping[str, Any], count: int, experts: int) -> tuple[int, ...]:
    """The layers a Qwen MoE config leaves dense: listed in ``mlp_only_layers``, or skipped by
    ``decoder_sparse_step`` (every layer when it has no experts)."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    only = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(count) if i in only or not (experts > 0 and (i + 1) % step == 0))


def routed_table(model: Module, names: ExpertNames) -> dict[str, Entry]:
    """Every tensor of model's Hugging Face layout, routed layers and latent attention included."""
    out = dense_table(model)
    routed = [i for i in range(model.num_layers) if model._mlp_of(i)["mlp_block"] == "routed"]
    latent = model.attention_block == "latent"
    replaced = {(f"layers_{i}", "mlp") for i in routed}
    if latent:
        replaced |= {(f"layers_{i}", "attention") for i in range(model.num_layers)}
    out = {name: entry for name, entry in out.items()
           if not any(path[:2] in replaced for path in entry.paths)}

    def add(name: str, paths: Sequence[Path], hf_shape: tuple[int, ...], dew_shapes: Sequence[tuple[int, ...]],
            layout: TensorLayout, index: int | None = None) -> None:
        out[name] = Entry(name, tuple(paths), tuple(hf_shape), tuple(dew_shapes), layout, index)

    embed, experts = model.emb_features, model.experts
    routing = model.routing
    hidden = (routing.hidden_features if routing else None) or model.mlp_features
    for i in range(model.num_layers):
        hf, dew = f"model.layers.{i}", f"layers_{i}"
        if latent:
            _latent_entries(add, model, hf, (dew, "attention"))
        if i not in routed:
            continue
        block, moe = f"{hf}.{names.block}", (dew, "moe")
        add(f"{block}.gate.weight", [(*moe, "router")], (experts, embed), [(embed, experts)], transposed())
        if routing is not None and routing.score_correction:
            add(f"{block}.gate.e_score_correction_bias", [(*moe, "score_correction")], (experts,),
                [(experts,)], same())
        for j in range(experts):
            for theirs, mine in ((names.gate, "wi_gate"), (names.up, "wi")):
                add(f"{block}.experts.{j}.{theirs}.weight", [(*moe, mine)], (hidden, embed), [(embed, hidden)],
                    transposed(), j)
            add(f"{block}.experts.{j}.{names.down}.weight", [(*moe, "wo")], (embed, hidden), [(hidden, embed)],
                transposed(), j)
        shared = routing.shared_features if routing is not None else 0
        if shared and names.shared is not None:
            module = f"{block}.{names.shared}"
            for theirs, mine in (("gate_proj", "wi_gate"), ("up_proj", "wi")):
                add(f"{module}.{theirs}.weight", [(*moe, "shared", mine)], (shared, embed), [(embed, shared)],
                    transposed())
            add(f"{module}.down_proj.weight", [(*moe, "shared", "wo")], (embed, shared), [(shared, embed)],
                transposed())
        if routing is not None and routing.shared_gate and names.shared_gate is not None:
            add(f"{block}.{names.shared_gate}.weight", [(*moe, "shared_gate")], (1, embed), [(embed, 1)],
                transposed())
    return out


def _latent_entries(add: Any, model: Module, hf: str, attention: Path) -> None:
    """DeepSeek's attention tensors (``self_attn.q_a_proj`` ...) against LatentAttention's."""
    shape, embed, heads = model.latent, model.emb_features, model.num_heads
    qk = shape.qk_nope_head_features + shape.qk_rope_head_features
    down = shape.kv_lora_rank + shape.qk_rope_head_features
    at = f"{hf}.self_attn"
    if shape.q_lora_rank is None:
        add(f"{at}.q_proj.weight", [(*attention, "query")], (heads * qk, embed), [(embed, heads, qk)],
            heads_in(embed, heads, qk))
    else:
        rank = shape.q_lora_rank
        add(f"{at}.q_a_proj.weight", [(*attention, "query_down")], (rank, embed), [(embed, rank)], transposed())
        if model.qkv_bias:
            add(f"{at}.q_a_proj.bias", [(*attention, "query_down_bias")], (rank,), [(rank,)], same())
        add(f"{at}.q_a_layernorm.weight", [(*attention, "query_norm")], (rank,), [(rank,)], same())
        add(f"{at}.q_b_proj.weight", [(*attention, "query_up")], (heads * qk, rank), [(rank, heads, qk)],
            heads_in(rank, heads, qk))
    add(f"{at}.kv_a_proj_with_mqa.weight", [(*attention, "kv_down")], (down, embed), [(embed, down)],
        transposed())
    if model.qkv_bias:
        add(f"{at}.kv_a_proj_with_mqa.bias", [(*attention, "kv_down_bias")], (down,), [(down,)], same())
    add(f"{at}.kv_a_layernorm.weight", [(*attention, "kv_norm")], (shape.kv_lora_rank,),
        [(shape.kv_lora_rank,)], same())
    width = shape.qk_nope_head_features + shape.v_head_features
    add(f"{at}.kv_b_proj.weight", [(*attention, "kv_up")], (heads * width, shape.kv_lora_rank),
        [(shape.kv_lora_rank, heads, width)], heads_in(shape.kv_lora_rank, heads, width))
    value = shape.v_head_features
    add(f"{at}.o_proj.weight", [(*attention, "out")], (embed, heads * value), [(heads, value, embed)],
        heads_out(embed, heads, value))
    if model.qkv_bias:
        add(f"{at}.o_proj.bias", [(*attention, "out_bias")], (embed,), [(embed,)], same())


@dataclass(frozen=True)
class RoutedFamily(Family):
    """A family whose feed-forward blocks are routed experts: its table names them per expert."""

    names: ExpertNames = ExpertNames()

    def table(self, model: Module) -> dict[str, Entry]:
        """The converter table of model in this family's layout."""
        return routed_table(model, self.names)
