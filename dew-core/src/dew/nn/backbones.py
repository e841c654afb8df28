"""Generic backbones, registered by name in the ``dew.models`` group.

>>> import jax, jax.numpy as jnp
>>> model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=1, num_heads=2,
...                           mlp_features=16, max_seq_len=8)
>>> variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
>>> model.apply(variables, jnp.zeros((2, 5), jnp.int32)).shape
(2, 5, 16)
"""

from __future__ import annotations

from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.layers import DecoderLayer, Embed, RMSNorm
from dew.nn.pipeline import run_stack
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
    ("einsum", or jax.nn.dot_product_attention's "xla" or "cudnn"); ``remat``
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
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    head_features: int | None = None
    position_embedding: Literal["learned", "rotary"] = "learned"
    mlp_activation: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = False
    num_kv_heads: int | None = None
    rope_base: float = 10_000.0
    norm_epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention: Literal["einsum", "xla", "cudnn"] = "einsum"
    remat: Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"] = "none"
    experts: int = 0
    experts_per_token: int = 2
    expert_capacity: float = 1.25
    scan_layers: bool = False

    def _check(self) -> None:
        for name in ("vocab_size", "emb_features", "num_layers", "num_heads", "mlp_features",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"CausalTransformer.{name} must be at least 1, got "
                                 f"{getattr(self, name)}.")
        if self.head_features is None and self.emb_features % self.num_heads:
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
        mlp = (3 if self.mlp_activation == "swiglu" else 2) * self.emb_features * self.mlp_features
        if self.experts:  # a token passes through experts_per_token experts and the router
            mlp = self.experts_per_token * mlp + self.emb_features * self.experts
        weights = self.num_layers * (attention + mlp) + self.emb_features * self.vocab_size
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
            "rope_base": self.rope_base, "norm_epsilon": self.norm_epsilon, **kinds,
        }
        if self.scan_layers:
            def rematerialized(body: Any) -> Any:
                if self.remat == "none":
                    return body
                return nn.remat(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)

            x_btd = run_stack(self, DecoderLayer, self.num_layers, x_btd, positions, segment_ids,
                              decode=decode, wrap=rematerialized, num_heads=self.num_heads,
                              head_features=self.head_width, mlp_features=self.mlp_features,
                              max_len=self.max_seq_len, **layer_options)
        layer_class: Any = DecoderLayer
        if self.remat != "none" and not decode:
            layer_class = nn.remat(DecoderLayer, policy=REMAT_POLICIES[self.remat])
        for i in range(0 if self.scan_layers else self.num_layers):
            layer = layer_class(
                self.num_heads, self.head_width, self.mlp_features, self.max_seq_len,
                rotary=self.position_embedding == "rotary", mlp_activation=self.mlp_activation,
                attention=self.attention, num_kv_heads=self.num_kv_heads,
                rope_base=self.rope_base, norm_epsilon=self.norm_epsilon,
                experts=self.experts, experts_per_token=self.experts_per_token,
                expert_capacity=self.expert_capacity, name=f"layers_{i}", **kinds,
            )
            if layer_class is DecoderLayer:
                x_btd = layer(x_btd, positions, decode=decode, segment_ids=segment_ids)
            elif segment_ids is None:
                x_btd = layer(x_btd, positions)
            else:
                x_btd = layer(x_btd, positions, segment_ids=segment_ids)

        x_btd = RMSNorm(self.norm_epsilon, name="final_norm", **kinds)(x_btd)
        if self.tie_embeddings:
            logits_btv = embed.attend(x_btd)
        else:
            kernel_dv = param(self, "head", nn.initializers.lecun_normal(),
                              (self.emb_features, self.vocab_size), (axes.EMBED, axes.VOCAB),
                              self.param_dtype)
            logits_btv = jnp.einsum("btd,dv->btv", x_btd, kernel_dv.astype(self.dtype))
        logits_btv = constrain(logits_btv, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_VOCAB))
        return logits_btv.astype(jnp.float32)
