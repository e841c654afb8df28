"""Block diffusion (BD3-LM): autoregressive over blocks, masked diffusion inside each block.

The window of seq_len ids is cut into blocks of block_size. Each block gets
its own time t and is masked as in MDLM; the model reads the noisy window and
the clean window side by side (2 seq_len ids, both at positions 0..seq_len-1)
under a block-causal mask: a noisy token sees its own noisy block and the
clean blocks before it, a clean token sees the clean blocks up to its own.
The loss is the (1/t)-weighted cross-entropy of the masked tokens per token.
With block_size 1 this is the autoregressive loss in expectation; with one
block covering the window it is exactly MaskedDiffusionObjective's loss.
Sampling writes a block at a time with the clean blocks' keys and values
cached (``dew.sampling.block_generate``).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.diffusion.masking import check_temperature, mask_tokens, nelbo_weight, stratified_times
from dew.nn.kinds import TokenModel
from dew.objectives.base import (
    EMASpec,
    Variables,
)
from dew.objectives.masked_diffusion import TokenDiffusion, masked_cross_entropy
from dew.sampling.masked import block_generate
from dew.telemetry.artifacts import Artifact

__all__ = ["BlockDiffusionObjective", "block_causal_mask"]


def block_causal_mask(seq_len: int, block_size: int) -> jax.Array:
    """The [1, 1, 2L, 2L] mask over (noisy window, clean window) that BD3-LM trains with."""
    block = jnp.arange(seq_len) // block_size
    same = block[:, None] == block[None, :]
    before = block[:, None] > block[None, :]
    up_to = block[:, None] >= block[None, :]
    top = jnp.concatenate([same, before], axis=1)  # noisy queries
    bottom = jnp.concatenate([jnp.zeros_like(same), up_to], axis=1)  # clean queries
    return jnp.concatenate([top, bottom], axis=0)[None, None]


@dataclass(frozen=True)
class BlockDiffusionObjective(TokenDiffusion):
    """BD3-LM over windows of seq_len ids in blocks of block_size, with a TokenDenoiser."""

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = TokenModel

    model: nn.Module
    seq_len: int
    _: KW_ONLY
    block_size: int = 4
    t_min: float = 1e-3
    tokenizer: Any = None
    prompt: str | None = None
    preview_rows: int = 2
    preview_steps: int = 8
    temperature: float = 1.0
    ema: EMASpec | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.seq_len % self.block_size:
            raise ValueError(f"BlockDiffusionObjective.seq_len={self.seq_len} must be a positive "
                             f"multiple of block_size={self.block_size}.")
        if self.seq_len > getattr(self.model, "max_seq_len", self.seq_len):  # any flax Module
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len="
                             f"{self.model.max_seq_len}.")
        for name in ("preview_rows", "preview_steps"):  # a preview of 0 unmasking steps decodes mask ids
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be at least 1, got {getattr(self, name)}.")
        check_temperature(type(self).__name__, self.temperature)
        if not 0.0 < self.t_min < 1.0:  # NaN too
            raise ValueError(f"{type(self).__name__}.t_min must lie in (0, 1), got {self.t_min}.")
        if self.prompt and self.tokenizer is not None:  # the preview's prefix: whole blocks, as generate's
            self.prefix_of(self.prompt, self.preview_rows)

    def logits(self, variables: Variables, noisy: jax.Array, tokens: jax.Array) -> jax.Array:
        """The model's logits [B, L, V] at the noisy window, given the clean one beside it."""
        rows, length = tokens.shape
        positions = jnp.broadcast_to(jnp.tile(jnp.arange(length), 2), (rows, 2 * length))
        both = jnp.concatenate([noisy, tokens], axis=1)
        logits = self.model.apply(variables, both, positions, block_causal_mask(length, self.block_size))
        return logits[:, :length]

    def per_token(self, variables: Variables, tokens: jax.Array, key: jax.Array) -> jax.Array:
        """(1/t_block) CE of each masked token, 0 for the rest, [B, seq_len]."""
        rows, length = tokens.shape
        blocks = length // self.block_size
        time_key, mask_key = jax.random.split(key)
        t = stratified_times(time_key, rows * blocks, self.t_min).reshape(rows, blocks)
        t = jnp.repeat(t, self.block_size, axis=1)
        noisy, masked = mask_tokens(mask_key, tokens, t, self.mask_id)
        return masked_cross_entropy(self.logits(variables, noisy, tokens), tokens, masked,
                                    nelbo_weight(t))

    def generate(self, variables: Variables, key: jax.Array, rows: int, *,
                 prefix: jax.Array | None = None, steps: int | None = None) -> jax.Array:
        """rows samples of seq_len ids written block by block (prefix fills whole first blocks)."""
        return block_generate(self.model, variables, rows, self.seq_len, self.block_size, key,
                              steps=steps or self.preview_steps, temperature=self.temperature,
                              prefix=prefix)

    def prefix_of(self, prompt: str, rows: int) -> jax.Array:
        """prompt's ids [rows, P] for generate's prefix: whole blocks, shorter than seq_len."""
        from dew.objectives.diffusion_pipeline import prefix_ids

        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} has no tokenizer to read a prompt with.")
        return prefix_ids(self.tokenizer, prompt, rows, self.seq_len, self.block_size)

    def preview(self, variables: Variables, key: jax.Array) -> Artifact | None:
        if self.tokenizer is None:
            return None
        prefix = self.prefix_of(self.prompt, self.preview_rows) if self.prompt else None
        # One compiled program for every block (eager, each block's loop would compile on its own).
        write = jax.jit(lambda v, k: self.generate(v, k, self.preview_rows, prefix=prefix))
        return Artifact("sample", "text", self.decode(write(variables, key)))
