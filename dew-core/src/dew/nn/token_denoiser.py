"""A bidirectional transformer over token ids for masked and block diffusion.

Token id ``vocab_size`` is the mask token (the absorbing state); the model
embeds vocab_size + 1 ids and predicts logits over the vocab_size real ones.
Attention is bidirectional unless a mask is given (block diffusion passes a
block-causal one). ``past`` carries keys and values of earlier tokens per
layer; each call's own are sown under ``intermediates`` (apply with
``mutable=["intermediates"]`` to read them), which is the KV cache block
diffusion samples with. Every parameter carries logical axis names.

>>> import jax, jax.numpy as jnp
>>> model = TokenDenoiser(vocab_size=5, emb_features=8, num_layers=1, num_heads=2,
...                       mlp_features=16, max_seq_len=4)
>>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
>>> model.apply(variables, jnp.asarray([[0, 5, 5, 2]])).shape
(1, 4, 5)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.conditioning import Dense
from dew.nn.dit import TOKENS, Attention
from dew.nn.layers import RMSNorm, built_problems, heads_problems
from dew.nn.sharding import constrain, param

__all__ = ["TokenDenoiser"]


class TokenDenoiser(nn.Module):
    """Pre-norm transformer layers over ids [B, T] (id vocab_size = mask) to logits [B, T, vocab_size].

    ``__call__(tokens, positions=None, mask=None, past=None)``: positions [B, T]
    default to 0..T-1 (after past's length); mask [B or 1, 1, T, P + T] keeps
    True pairs; past is one (keys, values) per layer.
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int

    reads_whole_sequence: ClassVar[bool] = True  # dew.evaluations.base.ReadsWholeSequence: no causal text task

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """Heads that do not split the width, said before anything is built (dew.registry.ChecksFields)."""
        return built_problems(cls, fields, lambda model: heads_problems(model.emb_features, model.num_heads))

    @property
    def mask_id(self) -> int:
        """The id of the mask (absorbing) token."""
        return self.vocab_size

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 mask: jax.Array | None = None,
                 past: Sequence[tuple[jax.Array, jax.Array]] | None = None) -> jax.Array:
        ids_bt = jnp.asarray(tokens, jnp.int32)
        if ids_bt.ndim != 2:
            raise ValueError(f"TokenDenoiser takes ids [batch, length], got shape {tuple(ids_bt.shape)}.")
        batch, length = ids_bt.shape
        if positions is None:
            start = 0 if past is None else past[0][0].shape[1]
            positions_bt = jnp.broadcast_to(start + jnp.arange(length), (batch, length))
        else:
            positions_bt = positions
        # v: the vocabulary and the mask id; t: the positions up to max_seq_len
        embed_vd = param(self, "embed", nn.initializers.normal(0.02),
                         (self.vocab_size + 1, self.emb_features), (axes.VOCAB, axes.EMBED))
        position_td = param(self, "position", nn.initializers.normal(0.02),
                            (self.max_seq_len, self.emb_features), (None, axes.EMBED))
        x_btd = jnp.take(embed_vd, ids_bt, axis=0) + jnp.take(position_td, positions_bt, axis=0)
        x_btd = constrain(x_btd, TOKENS)
        for i in range(self.num_layers):
            h_btd = RMSNorm(name=f"attention_norm_{i}")(x_btd)
            x_btd = x_btd + Attention(self.num_heads, name=f"attention_{i}")(
                h_btd, mask, past=None if past is None else past[i])
            h_btd = RMSNorm(name=f"mlp_norm_{i}")(x_btd)
            h_btm = nn.gelu(Dense(self.mlp_features, name=f"mlp_in_{i}")(h_btd))
            h_btd = Dense(self.emb_features, axes.MLP, axes.EMBED, name=f"mlp_out_{i}")(h_btm)
            x_btd = constrain(x_btd + h_btd, TOKENS)
        x_btd = RMSNorm(name="final_norm")(x_btd)
        head_dv = param(self, "head", nn.initializers.lecun_normal(),
                        (self.emb_features, self.vocab_size), (axes.EMBED, axes.VOCAB))
        logits_btv = jnp.einsum("btd,dv->btv", x_btd, head_dv)
        return constrain(logits_btv, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_VOCAB))
