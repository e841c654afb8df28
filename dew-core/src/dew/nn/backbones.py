"""Generic backbones, registered by name in the ``dew.models`` group.

>>> import jax, jax.numpy as jnp
>>> model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=1, num_heads=2,
...                           mlp_features=16, max_seq_len=8)
>>> variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
>>> model.apply(variables, jnp.zeros((2, 5), jnp.int32)).shape
(2, 5, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.experts import Routing
from dew.nn.latent_attention import Latent
from dew.nn.layers import (
    ATTENTION_BLOCKS,
    MLP_ACTIVATIONS,
    MLP_BLOCKS,
    NORM_PLACEMENTS,
    QK_NORMS,
    DecoderLayer,
    Embed,
    RMSNorm,
)
from dew.nn.pipeline import run_stack
from dew.nn.rotary import RopeScaling
from dew.nn.sharding import constrain, param

__all__ = ["REMAT_POLICIES", "CausalTransformer"]

# What each decoder layer keeps for the backward pass (jax.checkpoint
# policies): "none" keeps everything (no rematerialization), "full" keeps
# only the layer's input and recomputes the rest, the others keep matmul
# outputs and recompute the cheap elementwise work around them.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


_CAPACITY = 1.25  # CausalTransformer.expert_capacity's default, which dropless routing never reads


class CausalTransformer(nn.Module):
    """A decoder-only transformer over token ids, with a cached decode path.

    Pre-norm layers (RMSNorm, norm_epsilon) of causal attention and a
    feed-forward block. Attention has num_heads query heads sharing
    num_kv_heads key/value heads (grouped-query attention; None gives every
    query head its own). Positions are learned (a table of max_seq_len rows)
    or rotary (frequencies from rope_base); the feed-forward block is GELU or
    SwiGLU; the output head is the embedding table (tied) or a separate
    matrix. With rotary positions, SwiGLU and no biases it is exactly
    Hugging Face's Llama, which ``dew.pretrained`` reads and writes. Parameters live under
    ``embed``, ``position`` (learned only), ``layers_0`` ... ``layers_{n-1}``,
    ``final_norm`` and ``head`` (untied only); each is named by its logical axes.

    ``__call__(tokens, positions=None, *, decode=False)`` maps int32 ids
    [B, T] to float32 logits [B, T, vocab_size]. With ``decode=True`` it reads
    and writes the 'cache' collection (apply with ``mutable=["cache"]``):
    keys and values of every layer in slots of size max_seq_len, and ``index``,
    each row's next free slot. positions default to the row's index onward;
    pass them to write each row at its own place (prompts of different lengths).

    ``attention`` picks how attention is computed in training and prefill
    ("einsum", or jax.nn.dot_product_attention's "xla" or "cudnn", each of which gathers every
    key and value onto each device of the mesh's sequence axis; or "ring", which passes them
    around that axis blockwise, dew.nn.ring_attention); ``remat``
    names a rematerialization policy of ``REMAT_POLICIES`` applied to every
    layer. Both change speed and memory only, never the parameters.
    ``scan_layers`` stores the layers as one stack under ``layers`` (every
    weight with a leading ``layers`` axis, the one a mesh's ``stage`` axis
    splits into pipeline stages; dew.nn.pipeline) and runs them as one scan,
    which compiles one layer instead of num_layers. The function is the same.
    segment_ids [B, T] (training only) number documents packed into one row:
    attention never crosses from one document to another.

    experts above 0 replaces every layer's feed-forward block with a
    mixture of that many experts (dew.nn.moe.MoEBlock, under ``moe``), each
    token routed to experts_per_token of them, each expert taking at most
    expert_capacity times its even share of a sequence's tokens. The blocks
    sow their load-balancing loss into the "moe" collection, which
    LMObjective reads and adds to its loss.

    The remaining fields are the parts published decoders differ in, each
    computing exactly what that architecture does (``dew.families`` names the
    presets: Llama, Mistral, Qwen 2 and 3, Gemma 1 to 3, Phi-3, OLMo 2):

    - norm_placement: "pre" (Llama), "sandwich" (Gemma 2 and 3: a norm before
      and after each block) or "post" (OLMo 2: after each block only);
      norm_offset stores every RMSNorm weight as an offset from one (Gemma).
    - qk_norm: RMSNorm of queries and keys before the rotation, "head" (per
      head, Qwen 3 and Gemma 3) or "projection" (over all heads, OLMo 2).
    - qkv_bias, out_bias, mlp_bias: biases on the query/key/value projections,
      the attention output and the feed-forward matrices.
    - rope_scaling (dew.nn.rotary.RopeScaling: linear, llama3, yarn) and
      rotary_fraction (the share of a head that rotates, Phi-3's partial
      rotary); local_rope_base is the base of the sliding-window layers when
      it differs from rope_base (Gemma 3), those layers then unscaled.
    - sliding_window: how many keys a query sees (itself included), in the
      layers sliding_layers lists (None: all); the others see every key.
    - attention_softcap and logit_softcap bound attention scores and logits
      by ``c * tanh(x / c)`` (Gemma 2); query_pre_attn_scalar replaces the
      head width in the score scale ``1/sqrt(...)``; scale_embeddings
      multiplies the embeddings by ``sqrt(emb_features)`` (Gemma).
    - mlp_activation "geglu" gates with tanh-approximated GELU (Gemma).
    - attention_block and mlp_block name each layer's kind of block:
      "latent" is DeepSeek's multi-head latent attention, its shapes in
      latent (dew.nn.latent_attention.Latent; qkv_bias then puts biases on
      its down-projections and output); "routed" the routed experts of
      Mixtral, Qwen-MoE and DeepSeek-V3 (dew.nn.experts.RoutedExperts under
      ``moe``: experts of them, experts_per_token per token, the other
      options in routing), except in dense_layers, whose feed-forward block
      is dense (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers).
    - family names the published architecture the parts reproduce
      (``dew.families``): Pretrained.save writes that family's layout
      (None: Llama's, as before families existed).
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    head_features: int | None = None
    position_embedding: Literal["learned", "rotary"] = "learned"
    mlp_activation: Literal["gelu", "swiglu", "geglu"] = "gelu"  # layers.MLP_ACTIVATIONS; Gemma's geglu
    tie_embeddings: bool = False
    num_kv_heads: int | None = None
    rope_base: float = 10_000.0
    norm_epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention: Literal["einsum", "xla", "cudnn", "ring"] = "einsum"
    remat: Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"] = "none"
    experts: int = 0
    experts_per_token: int = 2
    expert_capacity: float = _CAPACITY
    scan_layers: bool = False
    family: str | None = None
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"
    norm_offset: bool = False
    qk_norm: Literal["none", "head", "projection"] = "none"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0
    local_rope_base: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    attention_softcap: float | None = None
    logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    scale_embeddings: bool = False
    attention_block: Literal["grouped_query", "latent"] = "grouped_query"
    mlp_block: Literal["dense", "routed"] = "dense"
    latent: Latent | None = None
    routing: Routing | None = None
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """What _check refuses in these fields, said before anything is built (dew.registry.ChecksFields):
        a recipe's model is then refused by ``dew train --check`` and at load, not at the first trace."""
        from dew.registry import validate_fields

        try:  # a recipe gives latent, routing and rope_scaling as mappings: made their types first
            cls(**validate_fields(cls, dict(fields), "CausalTransformer"))._check()
        except (ValueError, TypeError) as error:
            return [((), str(error))]
        return []

    def _check(self) -> None:
        for name in ("vocab_size", "emb_features", "num_layers", "num_heads", "mlp_features",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"CausalTransformer.{name} must be at least 1, got "
                                 f"{getattr(self, name)}.")
        for name in ("dtype", "param_dtype"):
            try:
                floating = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
            except TypeError:
                floating = False
            if not floating:
                raise ValueError(f"CausalTransformer.{name}={getattr(self, name)!r} is not a floating dtype: the "
                                 "model computes and keeps its weights in floats (float32, bfloat16, float16). "
                                 "For int8 or 4-bit weights, quantize them (a recipe's quantization or "
                                 "lora.base).")
        if self.attention == "cudnn" and jnp.dtype(self.dtype) not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"CausalTransformer.attention='cudnn' runs cuDNN's fused kernel, which computes in "
                             f"bfloat16 or float16 only, and dtype is {jnp.dtype(self.dtype).name}: set "
                             "dtype=bfloat16 (the weights may stay float32 in param_dtype), or use "
                             "attention='xla'.")
        if self.attention_block == "latent" and self.latent is None:
            raise ValueError("CausalTransformer.attention_block='latent' needs latent (a "
                             "dew.nn.latent_attention.Latent: the latent ranks and head widths).")
        if self.mlp_block == "routed" and self.experts < 1:
            raise ValueError("CausalTransformer.mlp_block='routed' needs experts (how many routed "
                             "experts each layer has) of at least 1.")
        if self.routing is not None and self.routing.dropless and self.expert_capacity != _CAPACITY:
            raise ValueError(
                f"CausalTransformer.expert_capacity={self.expert_capacity} sizes capacity routing, and this "
                "model routes dropless (every token reaches its experts; the published MoE families do): it "
                "would change nothing. Drop it, or set routing.dropless=false to route with a capacity.")
        outside = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"CausalTransformer.dense_layers names layers {outside} of a model with "
                             f"num_layers={self.num_layers}; number them 0..{self.num_layers - 1}.")
        if self.scan_layers and 0 < len(set(self.dense_layers)) < self.num_layers:
            raise ValueError(
                f"CausalTransformer.scan_layers=True needs every layer alike, but dense_layers="
                f"{self.dense_layers} makes some feed-forward blocks dense and others routed. "
                "Set scan_layers=False for this model.")
        if self.attention_block != "latent" and self.head_features is None and self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features={self.emb_features} is not divisible by num_heads="
                f"{self.num_heads}; change one of them or set head_features explicitly."
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"Unknown remat {self.remat!r}; use one of "
                             f"{', '.join(map(repr, REMAT_POLICIES))}.")
        if self.experts < 0 or (self.experts and not 1 <= self.experts_per_token <= self.experts):
            raise ValueError(
                f"CausalTransformer.experts={self.experts} and experts_per_token="
                f"{self.experts_per_token}: experts must be 0 (a dense feed-forward block) or "
                "positive, with experts_per_token between 1 and experts."
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1
                                              or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"CausalTransformer.num_kv_heads={self.num_kv_heads} must divide num_heads="
                f"{self.num_heads}: each key/value head serves the same number of query heads."
            )
        choices = {"norm_placement": NORM_PLACEMENTS, "qk_norm": QK_NORMS,
                   "mlp_activation": MLP_ACTIVATIONS, "attention_block": ATTENTION_BLOCKS,
                   "mlp_block": MLP_BLOCKS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"CausalTransformer.{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(map(repr, allowed))}.")
        positive = {"head_features": self.head_features, "rope_base": self.rope_base,
                    "local_rope_base": self.local_rope_base, "attention_softcap": self.attention_softcap,
                    "logit_softcap": self.logit_softcap, "query_pre_attn_scalar": self.query_pre_attn_scalar}
        for name, value in positive.items():  # 0 or below: a division by zero, NaN at every step, or a width of 0
            if value is not None and not value > 0:
                unset = "" if name == "rope_base" else " (or None, unset)"
                raise ValueError(f"CausalTransformer.{name}={value} must be above 0{unset}.")
        if not self.norm_epsilon >= 0:
            raise ValueError(f"CausalTransformer.norm_epsilon={self.norm_epsilon} must be 0 or above: it is "
                             "added to the variance a norm divides by.")
        if not 0 < self.rotary_fraction <= 1:
            raise ValueError(f"CausalTransformer.rotary_fraction={self.rotary_fraction} must be in "
                             "(0, 1]: the share of each head's features that rotate.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"CausalTransformer.sliding_window={self.sliding_window} must be at "
                             "least 1 (or None: every layer sees every earlier key).")
        outside = [i for i in self.sliding_layers or () if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"CausalTransformer.sliding_layers names layers {outside} of a model "
                             f"with num_layers={self.num_layers}; number them 0..{self.num_layers - 1}.")
        if self.scan_layers and len(set(self._layer_parts())) > 1:
            raise ValueError(
                "CausalTransformer.scan_layers=True needs every layer alike, but sliding_layers="
                f"{self.sliding_layers} gives some layers a sliding window (or another rotary base) "
                "and others none. Set scan_layers=False for this model.")

    def _layer_parts(self) -> list[tuple[int | None, float, RopeScaling | None]]:
        """Each layer's window, rotary base and rotary scaling, in order."""
        out: list[tuple[int | None, float, RopeScaling | None]] = []
        for i in range(self.num_layers):
            slides = self.sliding_window is not None and (
                self.sliding_layers is None or i in self.sliding_layers)
            if slides and self.local_rope_base is not None:
                out.append((self.sliding_window, self.local_rope_base, None))
            else:
                out.append((self.sliding_window if slides else None, self.rope_base, self.rope_scaling))
        return out

    def _mlp_of(self, layer: int) -> dict[str, Any]:
        """Layer's feed-forward kind: its mlp_block and experts (dense in dense_layers)."""
        if self.mlp_block == "routed" and layer in self.dense_layers:
            return {"mlp_block": "dense", "experts": 0}
        return {"mlp_block": self.mlp_block, "experts": self.experts}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) at seq_len: 6 per weight the token
        passes through, plus the attention scores and their weighted sum (PaLM's estimate).

        >>> model = CausalTransformer(vocab_size=10, emb_features=4, num_layers=1, num_heads=2,
        ...                           mlp_features=8, max_seq_len=8, tie_embeddings=True)
        >>> model.flops_per_token(8)  # 6 * (4*4*4 + 2*4*8 + 4*10) + 12 * 1 * 4 * 8
        1392.0
        """
        width = self.num_heads * self.head_width
        kv_heads = self.num_kv_heads or self.num_heads
        attention = 2 * self.emb_features * width + 2 * self.emb_features * kv_heads * self.head_width
        if self.attention_block == "latent" and self.latent is not None:
            shape, heads, embed = self.latent, self.num_heads, self.emb_features
            qk = shape.qk_nope_head_features + shape.qk_rope_head_features
            width = heads * (qk + shape.v_head_features) // 2  # scores over qk, the sum over v
            query = (embed * heads * qk if shape.q_lora_rank is None
                     else shape.q_lora_rank * (embed + heads * qk))
            attention = (query + embed * (shape.kv_lora_rank + shape.qk_rope_head_features)
                         + shape.kv_lora_rank * heads * (shape.qk_nope_head_features + shape.v_head_features)
                         + heads * shape.v_head_features * embed)
        matrices = 2 if self.mlp_activation == "gelu" else 3
        dense = matrices * self.emb_features * self.mlp_features
        mlp = dense
        if self.experts:  # a token passes through experts_per_token experts and the router
            routing = self.routing if self.mlp_block == "routed" else None
            hidden = (routing.hidden_features if routing else None) or self.mlp_features
            mlp = self.experts_per_token * matrices * self.emb_features * hidden + self.emb_features * self.experts
            if routing is not None:
                mlp += 3 * self.emb_features * routing.shared_features
        sparse = self.num_layers - (len(set(self.dense_layers)) if self.mlp_block == "routed" else 0)
        weights = (self.num_layers * attention + sparse * mlp + (self.num_layers - sparse) * dense
                   + self.emb_features * self.vocab_size)
        return float(6 * weights + 12 * self.num_layers * width * seq_len)

    @property
    def head_width(self) -> int:
        """The per-head width: head_features, or emb_features // num_heads."""
        return self.head_features or self.emb_features // self.num_heads

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, *, decode: bool = False,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        self._check()
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"CausalTransformer takes token ids of shape [batch, length], "
                             f"got shape {tuple(tokens.shape)}.")
        batch, length = tokens.shape
        if length > self.max_seq_len:
            raise ValueError(f"A sequence of {length} tokens is longer than max_seq_len="
                             f"{self.max_seq_len}; shorten it or build a longer model.")
        if decode:
            index = self.variable("cache", "index", jnp.zeros, (batch,), jnp.int32)
            if positions is None:
                positions = index.value[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
            positions = jnp.asarray(positions, jnp.int32)
            index.value = positions[:, -1] + 1
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch, length))

        kinds = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        embed = Embed(self.vocab_size, self.emb_features, name="embed", **kinds)
        x_btd = embed(tokens.astype(jnp.int32))
        if self.scale_embeddings:  # in the compute dtype, as Gemma rounds it
            x_btd = x_btd * jnp.asarray(self.emb_features ** 0.5, self.dtype)
        if self.position_embedding == "learned":
            table_sd = param(self, "position", nn.initializers.normal(0.02),
                             (self.max_seq_len, self.emb_features), (None, axes.EMBED),
                             self.param_dtype)
            x_btd = x_btd + jnp.take(table_sd.astype(self.dtype), positions, axis=0)
        elif self.position_embedding != "rotary":
            raise ValueError(f"Unknown position_embedding {self.position_embedding!r}; "
                             "use 'learned' or 'rotary'.")
        x_btd = constrain(x_btd, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED))

        layer_options = {
            "rotary": self.position_embedding == "rotary", "mlp_activation": self.mlp_activation,
            "attention": self.attention, "num_kv_heads": self.num_kv_heads,
            "norm_epsilon": self.norm_epsilon,
            "experts_per_token": self.experts_per_token, "expert_capacity": self.expert_capacity,
            "norm_placement": self.norm_placement, "norm_offset": self.norm_offset,
            "qk_norm": self.qk_norm, "qkv_bias": self.qkv_bias, "out_bias": self.out_bias,
            "mlp_bias": self.mlp_bias, "rotary_fraction": self.rotary_fraction,
            "attention_softcap": self.attention_softcap,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attention_block": self.attention_block, "latent": self.latent, "routing": self.routing,
            **kinds,
        }
        parts = self._layer_parts()
        if self.scan_layers:
            def rematerialized(body: Any) -> Any:
                if self.remat == "none":
                    return body
                return nn.remat(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)

            window, base, scaling = parts[0]
            x_btd = run_stack(self, DecoderLayer, self.num_layers, x_btd, positions, segment_ids,
                              decode=decode, wrap=rematerialized, num_heads=self.num_heads,
                              head_features=self.head_width, mlp_features=self.mlp_features,
                              max_len=self.max_seq_len, window=window, rope_base=base,
                              rope_scaling=scaling, **self._mlp_of(0), **layer_options)
        layer_class: Any = DecoderLayer
        if self.remat != "none" and not decode:
            layer_class = nn.remat(DecoderLayer, policy=REMAT_POLICIES[self.remat])
        for i in range(0 if self.scan_layers else self.num_layers):
            window, base, scaling = parts[i]
            layer = layer_class(
                self.num_heads, self.head_width, self.mlp_features, self.max_seq_len,
                window=window, rope_base=base, rope_scaling=scaling, name=f"layers_{i}",
                **self._mlp_of(i), **layer_options,
            )
            if layer_class is DecoderLayer:
                x_btd = layer(x_btd, positions, decode=decode, segment_ids=segment_ids)
            elif segment_ids is None:
                x_btd = layer(x_btd, positions)
            else:
                x_btd = layer(x_btd, positions, segment_ids=segment_ids)

        x_btd = RMSNorm(self.norm_epsilon, offset=self.norm_offset, name="final_norm", **kinds)(x_btd)
        if self.tie_embeddings:
            logits_btv = embed.attend(x_btd)
        else:
            kernel_dv = param(self, "head", nn.initializers.lecun_normal(),
                              (self.emb_features, self.vocab_size), (axes.EMBED, axes.VOCAB),
                              self.param_dtype)
            logits_btv = jnp.einsum("btd,dv->btv", x_btd, kernel_dv.astype(self.dtype))
        if self.logit_softcap is not None:
            logits_btv = jnp.tanh(logits_btv / self.logit_softcap) * self.logit_softcap
        logits_btv = constrain(logits_btv, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_VOCAB))
        return logits_btv.astype(jnp.float32)
