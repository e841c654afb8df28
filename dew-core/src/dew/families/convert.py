"""The converter table: each Hugging Face tensor, the dew parameters it holds, and how.

One table per model, used in both directions: ``Pretrained.load`` reads
each tensor name and moves it to its dew path(s), ``Pretrained.save``
gathers the dew path(s) and writes the tensor. Every move is a transpose, a
reshape, or a split/concatenation along the rows, so a round trip is
bitwise.

dew keeps kernels as [in, out] (attention as [embed, heads, head_dim] and
[heads, head_dim, embed]); torch's Linear keeps [out, in]. The dense
families share one naming scheme (``model.layers.{i}.self_attn.q_proj``,
``mlp.gate_proj``, ...); they differ in which tensors exist (biases, q/k
norms, the norms around each block) and Phi-3 fuses q/k/v and gate/up into
one tensor each. The table follows the model's parts, so each family's
table is this one function applied to a model built with its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flax.linen import Module

__all__ = ["Entry", "TensorLayout", "dense_table", "fused", "heads_in", "heads_out", "reshaped", "same",
           "transposed"]

Path = tuple[str, ...]


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor moves: to_hf(dew arrays) -> HF array; from_hf(HF array) -> dew arrays."""

    to_hf: Callable[[Sequence[np.ndarray]], np.ndarray]
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor: the dew path(s) it holds, both shapes, and its layout.

    With index, the tensor is one slice of each dew path along its first
    dimension (one expert of a stacked [experts, ...] weight, which a
    checkpoint stores expert by expert); dew_shapes are then the slices'.
    """

    name: str
    paths: tuple[Path, ...]
    hf_shape: tuple[int, ...]
    dew_shapes: tuple[tuple[int, ...], ...]
    layout: TensorLayout
    index: int | None = None

    @property
    def where(self) -> str:
        """The dew path(s), as messages name them."""
        return " + ".join(f"params/{'/'.join(p)}" for p in self.paths)


def same() -> TensorLayout:
    """The same array in both."""
    return TensorLayout(lambda arrays: arrays[0], lambda array: (array,))


def transposed() -> TensorLayout:
    """A Linear weight: dew [in, out], HF [out, in]."""
    return TensorLayout(lambda arrays: arrays[0].T, lambda array: (array.T,))


def reshaped(dew_shape: tuple[int, ...], hf_shape: tuple[int, ...]) -> TensorLayout:
    """The same values in another shape (a bias or norm scale per head: [heads, width] vs [heads*width])."""
    return TensorLayout(lambda arrays: arrays[0].reshape(hf_shape), lambda array: (array.reshape(dew_shape),))


def heads_in(embed: int, count: int, width: int) -> TensorLayout:
    """A q/k/v projection: dew [embed, heads, width], HF [heads*width, embed]."""
    return TensorLayout(lambda arrays: arrays[0].reshape(embed, count * width).T,
                  lambda array: (array.T.reshape(embed, count, width),))


def heads_out(embed: int, count: int, width: int) -> TensorLayout:
    """The attention output: dew [heads, width, embed], HF [embed, heads*width]."""
    return TensorLayout(lambda arrays: arrays[0].reshape(count * width, embed).T,
                  lambda array: (array.T.reshape(count, width, embed),))


def fused(parts: Sequence[tuple[TensorLayout, int]]) -> TensorLayout:
    """Several tensors stacked along HF's rows (Phi-3's qkv_proj, gate_up_proj): (layout, rows) each."""
    bounds = np.cumsum([rows for _, rows in parts])[:-1]

    def to_hf(arrays: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate([layout.to_hf([a]) for (layout, _), a in zip(parts, arrays, strict=True)],
                              axis=0)

    def from_hf(array: np.ndarray) -> tuple[np.ndarray, ...]:
        pieces = np.split(array, bounds, axis=0)
        return tuple(layout.from_hf(piece)[0] for (layout, _), piece in zip(parts, pieces, strict=True))

    return TensorLayout(to_hf, from_hf)


def _norms(model: Module) -> list[tuple[str, str]]:
    """(dew norm name, HF norm name) of a layer, by where the model's norms sit."""
    return {
        "pre": [("attention_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")],
        "sandwich": [("attention_norm", "input_layernorm"),
                     ("attention_post_norm", "post_attention_layernorm"),
                     ("mlp_norm", "pre_feedforward_layernorm"),
                     ("mlp_post_norm", "post_feedforward_layernorm")],
        "post": [("attention_post_norm", "post_attention_layernorm"),
                 ("mlp_post_norm", "post_feedforward_layernorm")],
    }[model.norm_placement]


def dense_table(model: Module, *, fuse: bool = False) -> dict[str, Entry]:
    """Every tensor of model's dense Hugging Face layout, by name (fuse: Phi-3's fused projections)."""
    embed, mlp, vocab = model.emb_features, model.mlp_features, model.vocab_size
    heads, kv_heads, width = model.num_heads, model.num_kv_heads or model.num_heads, model.head_width
    out: dict[str, Entry] = {}

    def add(name: str, paths: Sequence[Path], hf_shape: tuple[int, ...],
            dew_shapes: Sequence[tuple[int, ...]], layout: TensorLayout) -> None:
        out[name] = Entry(name, tuple(paths), tuple(hf_shape), tuple(dew_shapes), layout)

    add("model.embed_tokens.weight", [("embed", "embedding")], (vocab, embed), [(vocab, embed)], same())
    add("model.norm.weight", [("final_norm", "scale")], (embed,), [(embed,)], same())
    if not model.tie_embeddings:
        add("lm_head.weight", [("head",)], (vocab, embed), [(embed, vocab)], transposed())
    counts = {"query": heads, "key": kv_heads, "value": kv_heads}
    for i in range(model.num_layers):
        hf, dew = f"model.layers.{i}", f"layers_{i}"
        attention = (dew, "attention")
        if fuse:
            rows = sum(counts.values()) * width
            add(f"{hf}.self_attn.qkv_proj.weight", [(*attention, kind) for kind in counts], (rows, embed),
                [(embed, n, width) for n in counts.values()],
                fused([(heads_in(embed, n, width), n * width) for n in counts.values()]))
        else:
            for letter, (kind, count) in zip("qkv", counts.items(), strict=True):
                add(f"{hf}.self_attn.{letter}_proj.weight", [(*attention, kind)], (count * width, embed),
                    [(embed, count, width)], heads_in(embed, count, width))
        if model.qkv_bias:
            for letter, (kind, count) in zip("qkv", counts.items(), strict=True):
                add(f"{hf}.self_attn.{letter}_proj.bias", [(*attention, f"{kind}_bias")], (count * width,),
                    [(count, width)], reshaped((count, width), (count * width,)))
        add(f"{hf}.self_attn.o_proj.weight", [(*attention, "out")], (embed, heads * width),
            [(heads, width, embed)], heads_out(embed, heads, width))
        if model.out_bias:
            add(f"{hf}.self_attn.o_proj.bias", [(*attention, "out_bias")], (embed,), [(embed,)], same())
        for letter, kind, count in (("q", "query", heads), ("k", "key", kv_heads)):
            if model.qk_norm == "head":
                add(f"{hf}.self_attn.{letter}_norm.weight", [(*attention, f"{kind}_norm", "scale")],
                    (width,), [(width,)], same())
            elif model.qk_norm == "projection":
                add(f"{hf}.self_attn.{letter}_norm.weight", [(*attention, f"{kind}_norm", "scale")],
                    (count * width,), [(count, width)], reshaped((count, width), (count * width,)))
        if fuse:
            add(f"{hf}.mlp.gate_up_proj.weight", [(dew, "mlp", "wi_gate"), (dew, "mlp", "wi")],
                (2 * mlp, embed), [(embed, mlp), (embed, mlp)],
                fused([(transposed(), mlp), (transposed(), mlp)]))
        else:
            for name, kind in (("gate_proj", "wi_gate"), ("up_proj", "wi")):
                add(f"{hf}.mlp.{name}.weight", [(dew, "mlp", kind)], (mlp, embed), [(embed, mlp)],
                    transposed())
        add(f"{hf}.mlp.down_proj.weight", [(dew, "mlp", "wo")], (embed, mlp), [(mlp, embed)], transposed())
        if model.mlp_bias:
            for name, kind, size in (("gate_proj", "wi_gate", mlp), ("up_proj", "wi", mlp),
                                     ("down_proj", "wo", embed)):
                add(f"{hf}.mlp.{name}.bias", [(dew, "mlp", f"{kind}_bias")], (size,), [(size,)], same())
        for mine, theirs in _norms(model):
            add(f"{hf}.{theirs}.weight", [(dew, mine, "scale")], (embed,), [(embed,)], same())
    return out
