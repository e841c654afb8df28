"""Absorbing-state (masked) diffusion over token ids, with MDLM's linear schedule.

At time t in (0, 1] each token has been replaced by the mask id with
probability t (alpha_t = 1 - t keeps it). The continuous-time negative ELBO
is E_t[(1/t) * sum over masked positions of -log p(x0 | x_t)] (MDLM), so
``nelbo_weight(t) = 1/t``. Reverse steps from t to s < t reveal each masked
token with probability (t - s) / t, drawing it from the model; revealed
tokens never change again.

>>> import jax, jax.numpy as jnp
>>> tokens = jnp.arange(6)[None]
>>> noisy, masked = mask_tokens(jax.random.key(0), tokens, jnp.ones((1, 6)), mask_id=9)
>>> noisy.tolist(), bool(masked.all())
([[9, 9, 9, 9, 9, 9]], True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_temperature", "mask_tokens", "nelbo_weight", "stratified_times", "unmask_step"]

_SMALLEST_TEMPERATURE = float(jnp.finfo(jnp.float32).tiny)  # below it the device flushes to 0


def check_temperature(owner: str, temperature: float) -> None:
    """Refuse a sampling temperature no draw can use: negative, NaN, or too small for float32."""
    if not (temperature == 0 or temperature >= _SMALLEST_TEMPERATURE):
        raise ValueError(f"{owner}.temperature must be 0 (greedy) or at least {_SMALLEST_TEMPERATURE:.3g}, "
                         f"got {temperature}.")


def stratified_times(key: jax.Array, rows: int, t_min: float = 1e-3) -> jax.Array:
    """rows times in [t_min, 1], one in each of rows equal strata (MDLM's low-discrepancy draw)."""
    offset = jax.random.uniform(key, (), jnp.float32)
    u = (offset + jnp.arange(rows, dtype=jnp.float32)) / rows
    return t_min + (1.0 - t_min) * u


def mask_tokens(key: jax.Array, tokens: jax.Array, t: jax.Array,
                mask_id: int) -> tuple[jax.Array, jax.Array]:
    """(noisy tokens, which were masked): each token masked with its probability t (broadcast)."""
    masked = jax.random.uniform(key, tokens.shape, jnp.float32) < t
    return jnp.where(masked, mask_id, tokens), masked


def nelbo_weight(t: jax.Array) -> jax.Array:
    """MDLM's weight of a masked token's cross-entropy at time t: -alpha'_t / (1 - alpha_t) = 1/t."""
    return 1.0 / t


def unmask_step(key: jax.Array, tokens: jax.Array, logits: jax.Array, t: jax.Array,
                s: jax.Array, mask_id: int, temperature: float = 1.0) -> jax.Array:
    """One reverse step from t to s: each masked token revealed with probability (t - s) / t.

    A revealed token is drawn from softmax(logits / temperature) (greedy at 0).
    """
    draw_key, reveal_key = jax.random.split(key)
    if temperature == 0:
        guess = jnp.argmax(logits, axis=-1)
    else:
        logits = logits.astype(jnp.float32)  # shifted so a tiny temperature sends the rest to -inf, not +inf
        guess = jax.random.categorical(draw_key, (logits - logits.max(-1, keepdims=True)) / temperature, axis=-1)
    reveal = jax.random.uniform(reveal_key, tokens.shape, jnp.float32) < (t - s) / t
    return jnp.where((tokens == mask_id) & reveal, guess.astype(tokens.dtype), tokens)
