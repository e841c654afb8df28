"""Ring attention: causal attention over a sequence split across devices, keys and values passed around.

The all-gather form (CausalSelfAttention's "einsum", "xla" and "cudnn")
gives every device every key and value, so a device's memory grows with the
whole sequence and its scores with (its queries x all keys). Here each
device keeps its own queries and passes its keys and values to the next
device of the sequence axis, n - 1 times (``ppermute`` inside
``shard_map``); every block of scores is folded into a running maximum, a
running sum and an unnormalized output (the blockwise softmax of flash
attention), so a device holds its own queries, one block of keys and
values, and one block of scores at a time. The backward runs the ring again
(a ``custom_vjp``): it recomputes each block's probabilities from the saved
log-sum-exp, and the keys' and values' gradients travel with them, home
after n steps.

Causal masking leaves half the blocks empty. Cut in n contiguous pieces,
device n - 1 would have n blocks of work and device 0 one; so the sequence
is cut in 2n chunks and device i holds chunks i and 2n - 1 - i (the zigzag
layout): every device computes its diagonal pair of chunks once and half a
block at every other step, the same work everywhere. The model's positions
stay contiguous on the sequence axis (device i holds chunks 2i and 2i + 1);
two ``ppermute``s of half a shard each move them into the zigzag layout on
the way in, and two move the output back. Masks come from the tokens'
global indices, which travel with the keys, and from segment_ids (packed
documents attend within their own document only), as in CausalSelfAttention.

>>> import jax, jax.numpy as jnp
>>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 4, 16)) for i in range(3))
>>> out = ring_attention(q, k, v)  # no mesh: one device, one block
>>> scores = jnp.einsum("bthk,bshk->bhts", q, k) / 4.0
>>> plain = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(jnp.where(jnp.tri(8, dtype=bool), scores, -jnp.inf)), v)
>>> bool(jnp.allclose(out, plain, atol=1e-5))
True
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dew.errors import DewError
from dew.nn import sharding as axes

if TYPE_CHECKING:
    from dew.typing import PyTree

__all__ = ["RingAttentionError", "ring_attention", "sequence_shards", "zigzag_order"]


class RingAttentionError(DewError, ValueError):
    """A model asks ring attention for something it does not compute (soft-capped scores)."""


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """The positions in the order the zigzag layout stores them: shard i holds chunks i and 2n-1-i.

    >>> zigzag_order(8, 2).tolist()  # chunks of 2: shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    _check_length(length, shards)
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def _check_length(length: int, shards: int) -> None:
    if length % (2 * shards):
        raise axes.SequenceSplitError(
            f"Ring attention cuts a sequence of {length} positions into 2 x {shards} chunks (two per "
            f"device of the sequence axis, MeshSpec.sequence={shards}); use a sequence length that is a "
            f"multiple of {2 * shards}.")


def sequence_shards() -> tuple[tuple[str, ...], int]:
    """The mesh axes the logical ``activation_length`` maps to (under the current mesh and axis
    rules), and how many devices they make; ``((), 1)`` without a mesh."""
    return axes.split_over(axes.ACTIVATION_LENGTH)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                   scale: float | None = None, window: int | None = None) -> jax.Array:
    """Causal attention of q [B, T, H, K] over k, v [B, T, G, K] (G key/value heads, H a multiple),
    with keys and values passed around the mesh axes the logical ``activation_length`` maps to.

    Query head h reads key/value head h // (H // G), as CausalSelfAttention
    does. segment_ids [B, T] keep packed documents apart; scale multiplies
    the scores (default 1/sqrt(K)); window limits each query to the window
    keys before it. Without a mesh (or with one device on the sequence
    axis) it is one block on one device.
    """
    q_bthk, k_bsgk, v_bsgk = q, k, v
    batch, length = q_bthk.shape[:2]
    names, shards = sequence_shards()
    scale = 1.0 / math.sqrt(q_bthk.shape[-1]) if scale is None else float(scale)
    segments_bt = (jnp.zeros((batch, length), jnp.int32) if segment_ids is None
                   else segment_ids.astype(jnp.int32))
    if shards == 1:
        index_t = jnp.arange(length, dtype=jnp.int32)
        out_bthk = _attend(q_bthk, k_bsgk, v_bsgk, index_t, segments_bt, (), 1, scale, window)
        return out_bthk.astype(q_bthk.dtype)
    _check_length(length, shards)
    local = functools.partial(_zigzag_ring, axis=names, shards=shards, scale=scale, window=window)
    rows = PartitionSpec(None, names)
    heads = PartitionSpec(None, names, None, None)
    out_bthk = jax.shard_map(local, in_specs=(heads, heads, heads, rows), out_specs=heads,
                             axis_names=frozenset(names), check_vma=False)(q_bthk, k_bsgk, v_bsgk, segments_bt)
    return out_bthk.astype(q_bthk.dtype)


def _zigzag_ring(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, *, axis: tuple[str, ...],
                 shards: int, scale: float, window: int | None) -> jax.Array:
    """One device's share: into the zigzag layout, around the ring, back to contiguous positions."""
    device = jax.lax.axis_index(axis)
    chunk = q.shape[1] // 2
    q, k, v, segments = (_to_zigzag(t, device, axis, shards) for t in (q, k, v, segments))
    steps = jnp.arange(chunk, dtype=jnp.int32)
    index = jnp.concatenate([device * chunk + steps, (2 * shards - 1 - device) * chunk + steps])
    out = _attend(q, k, v, index, segments, axis, shards, scale, window)
    return _from_zigzag(out, device, axis, shards)


def _home(chunk: int, shards: int) -> tuple[int, int]:
    """The device and slot (0: head, 1: tail) the zigzag layout gives chunk."""
    return (chunk, 0) if chunk < shards else (2 * shards - 1 - chunk, 1)


def _to_zigzag(t: jax.Array, device: jax.Array, axis: tuple[str, ...], shards: int) -> jax.Array:
    """Contiguous chunks (2i, 2i + 1 on device i) to zigzag ones (i, 2n - 1 - i): the even chunks move
    in one ppermute, the odd in another; a device receives one of each, its head being the even one
    when its own index is even."""
    half = t.shape[1] // 2
    even = jax.lax.ppermute(t[:, :half], axis, [(i, _home(2 * i, shards)[0]) for i in range(shards)])
    odd = jax.lax.ppermute(t[:, half:], axis, [(i, _home(2 * i + 1, shards)[0]) for i in range(shards)])
    head_even = device % 2 == 0
    return jnp.concatenate([jnp.where(head_even, even, odd), jnp.where(head_even, odd, even)], axis=1)


def _from_zigzag(t: jax.Array, device: jax.Array, axis: tuple[str, ...], shards: int) -> jax.Array:
    """The inverse of _to_zigzag."""
    half = t.shape[1] // 2
    head_even = device % 2 == 0
    head, tail = t[:, :half], t[:, half:]
    even, odd = jnp.where(head_even, head, tail), jnp.where(head_even, tail, head)
    even = jax.lax.ppermute(even, axis, [(_home(2 * i, shards)[0], i) for i in range(shards)])
    odd = jax.lax.ppermute(odd, axis, [(_home(2 * i + 1, shards)[0], i) for i in range(shards)])
    return jnp.concatenate([even, odd], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array, segments: jax.Array,
            axis: tuple[str, ...], shards: int, scale: float, window: int | None) -> jax.Array:
    return _forward(q, k, v, index, segments, axis, shards, scale, window)[0]


def _shift(tree: PyTree, axis: tuple[str, ...], shards: int) -> PyTree:
    """Every device's tree to the next device of the sequence ring."""
    ring = [(i, (i + 1) % shards) for i in range(shards)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), tree)


def _grouped(x: jax.Array, groups: int) -> jax.Array:
    """[B, T, H, K] as [B, T, G, N, K]: the query heads in groups of N per key/value head."""
    x_bthk = x
    b, t, h, k = x_bthk.shape
    return x_bthk.reshape(b, t, groups, h // groups, k)


def _mask(q_index: jax.Array, k_index: jax.Array, q_segments: jax.Array, k_segments: jax.Array,
          window: int | None) -> jax.Array:
    """[B, 1, 1, Tq, Tk]: causal by global index (within window if set), within one document."""
    causal_ts = q_index[:, None] >= k_index[None, :]
    if window is not None:
        causal_ts = causal_ts & (q_index[:, None] - k_index[None, :] < window)
    same_bts = q_segments[:, :, None] == k_segments[:, None, :]
    return (causal_ts[None] & same_bts)[:, None, None]


def _scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """[B, G, N, T, S] scaled scores of grouped queries [B, T, G, N, K] against keys [B, S, G, K]."""
    q_btgnk, k_bsgk = q, k
    return jnp.einsum("btgnk,bsgk->bgnts", q_btgnk, k_bsgk).astype(jnp.float32) * scale


def _block_forward(carry: tuple[jax.Array, ...], q: jax.Array, k: jax.Array, v: jax.Array,
                   mask: jax.Array, scale: float) -> tuple[jax.Array, ...]:
    """Fold one block of keys into (output, running max, running sum) of the queries q."""
    out_btgnk, peak_bgnt, total_bgnt = carry
    scores_bgnts = jnp.where(mask, _scores(q, k, scale), -jnp.inf)
    new_peak_bgnt = jnp.maximum(peak_bgnt, scores_bgnts.max(axis=-1))
    safe_bgnt = jnp.where(jnp.isneginf(new_peak_bgnt), 0.0, new_peak_bgnt)
    rescale_bgnt = jnp.exp(peak_bgnt - safe_bgnt)
    weights_bgnts = jnp.where(mask, jnp.exp(scores_bgnts - safe_bgnt[..., None]), 0.0)
    out_btgnk = out_btgnk * rescale_bgnt.transpose(0, 3, 1, 2)[..., None] + jnp.einsum(
        "bgnts,bsgk->btgnk", weights_bgnts, v.astype(jnp.float32))
    return out_btgnk, new_peak_bgnt, total_bgnt * rescale_bgnt + weights_bgnts.sum(axis=-1)


# The pieces of work one ring step does, as (queries, keys) parts of the two blocks of chunks: "all",
# the "head" chunk or the "tail" chunk. A device's own keys: every query against the head chunk,
# and the tail queries against the tail chunk (the head queries precede the tail keys). Keys from an
# earlier device: every query against their head chunk (their tail comes after all of this
# device's queries). Keys from a later device: the tail queries against all of them (their head
# and tail come after this device's head chunk, before its tail). Every piece is half a block or
# less, so no step holds more than half a block of scores.
Piece = tuple[str, str]
_OWN: tuple[Piece, ...] = (("all", "head"), ("tail", "tail"))
_ONE_BLOCK: tuple[Piece, ...] = (("all", "all"),)
_FROM_EARLIER: tuple[Piece, ...] = (("all", "head"),)
_FROM_LATER: tuple[Piece, ...] = (("tail", "all"),)


def _part(x: jax.Array, part: str, axis: int) -> jax.Array:
    """The head or tail half of x along axis (x itself for "all")."""
    if part == "all":
        return x
    half = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, half, axis=axis) if part == "head" else \
        jax.lax.slice_in_dim(x, half, x.shape[axis], axis=axis)


def _add(x: jax.Array, y: jax.Array, part: str, axis: int) -> jax.Array:
    """x with y added to its part along axis."""
    if part == "all":
        return x + y
    start = 0 if part == "head" else x.shape[axis] // 2
    return jax.lax.dynamic_update_slice_in_dim(x, _part(x, part, axis) + y, start, axis)


def _set(x: jax.Array, y: jax.Array, part: str, axis: int) -> jax.Array:
    if part == "all":
        return y
    start = 0 if part == "head" else x.shape[axis] // 2
    return jax.lax.dynamic_update_slice_in_dim(x, y, start, axis)


Keys = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # keys, values, their indices, their segments


def _piece_mask(piece: Piece, index: jax.Array, segments: jax.Array, keys: Keys,
                window: int | None) -> jax.Array:
    q_part, k_part = piece
    return _mask(_part(index, q_part, 0), _part(keys[2], k_part, 0), _part(segments, q_part, 1),
                 _part(keys[3], k_part, 1), window)


def _fold(pieces: tuple[Piece, ...], carry: tuple[jax.Array, ...], qg: jax.Array, index: jax.Array,
          segments: jax.Array, keys: Keys, scale: float, window: int | None) -> tuple[jax.Array, ...]:
    """Fold the pieces of one ring step into the running (output, max, sum)."""
    for q_part, k_part in pieces:
        mask = _piece_mask((q_part, k_part), index, segments, keys, window)
        part: tuple[jax.Array, ...] = (_part(carry[0], q_part, 1), _part(carry[1], q_part, 3),
                                       _part(carry[2], q_part, 3))
        part = _block_forward(part, _part(qg, q_part, 1), _part(keys[0], k_part, 1), _part(keys[1], k_part, 1),
                              mask, scale)
        carry = (_set(carry[0], part[0], q_part, 1), _set(carry[1], part[1], q_part, 3),
                 _set(carry[2], part[2], q_part, 3))
    return carry


def _from_earlier(shards: int, step: jax.Array, device: jax.Array) -> jax.Array:
    """Whether the keys a device holds at ring step `step` (> 0) came from an earlier device."""
    return (device - step) % shards < device


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array, segments: jax.Array,
             axis: tuple[str, ...], shards: int, scale: float,
             window: int | None) -> tuple[jax.Array, tuple[Any, ...]]:
    groups = k.shape[2]
    qg = _grouped(q, groups)
    b, t, g, n, d = qg.shape
    carry: tuple[jax.Array, ...] = (jnp.zeros((b, t, g, n, d), jnp.float32),
                                    jnp.full((b, g, n, t), -jnp.inf, jnp.float32), jnp.zeros((b, g, n, t), jnp.float32))
    keys = (k, v, index, segments)
    fold = functools.partial(_fold, qg=qg, index=index, segments=segments, scale=scale, window=window)
    carry = fold(_OWN if shards > 1 else _ONE_BLOCK, carry, keys=keys)
    if shards > 1:
        device = jax.lax.axis_index(axis)

        def step(number: jax.Array, state: tuple[Any, Keys]) -> tuple[Any, Keys]:
            carry, keys = state
            keys = _shift(keys, axis, shards)
            carry = jax.lax.cond(_from_earlier(shards, number, device),
                                 lambda c, k: fold(_FROM_EARLIER, c, keys=k),
                                 lambda c, k: fold(_FROM_LATER, c, keys=k), carry, keys)
            return carry, keys

        carry, _ = jax.lax.fori_loop(1, shards, step, (carry, keys))
    out, peak, total = carry
    # A query that sees no key (only with a window past a document's start, never causally) outputs 0.
    empty = total == 0
    out = out / jnp.where(empty, 1.0, total).transpose(0, 3, 1, 2)[..., None]
    logsumexp = jnp.where(empty, jnp.inf, peak + jnp.log(jnp.where(empty, 1.0, total)))
    result = out.reshape(b, t, g * n, d).astype(q.dtype)
    return result, (q, k, v, index, segments, result, logsumexp)


def _block_backward(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, logsumexp: jax.Array,
                    grad: jax.Array, dot: jax.Array, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's share of dq, dk, dv, from its probabilities recomputed against the saved logsumexp."""
    q_btgnk, k_bsgk, v_bsgk, grad_btgnk = q, k, v, grad
    weights_bgnts = jnp.where(mask, jnp.exp(_scores(q_btgnk, k_bsgk, scale) - logsumexp[..., None]), 0.0)
    dv_bsgk = jnp.einsum("bgnts,btgnk->bsgk", weights_bgnts, grad_btgnk)
    dweights_bgnts = jnp.einsum("btgnk,bsgk->bgnts", grad_btgnk, v_bsgk.astype(jnp.float32))
    dscores_bgnts = weights_bgnts * (dweights_bgnts - dot[..., None]) * scale
    dq_btgnk = jnp.einsum("bgnts,bsgk->btgnk", dscores_bgnts, k_bsgk.astype(jnp.float32))
    dk_bsgk = jnp.einsum("bgnts,btgnk->bsgk", dscores_bgnts, q_btgnk.astype(jnp.float32))
    return dq_btgnk, dk_bsgk, dv_bsgk


def _unfold(pieces: tuple[Piece, ...], grads: tuple[jax.Array, ...], qg: jax.Array, index: jax.Array,
            segments: jax.Array, keys: Keys, logsumexp: jax.Array, grad: jax.Array, dot: jax.Array,
            scale: float, window: int | None) -> tuple[jax.Array, ...]:
    """Add the pieces of one ring step to (dq, dk, dv); dk and dv belong to the keys held now."""
    dq, dk, dv = grads
    for q_part, k_part in pieces:
        mask = _piece_mask((q_part, k_part), index, segments, keys, window)
        dq_p, dk_p, dv_p = _block_backward(
            _part(qg, q_part, 1), _part(keys[0], k_part, 1), _part(keys[1], k_part, 1), mask,
            _part(logsumexp, q_part, 3), _part(grad, q_part, 1), _part(dot, q_part, 3), scale)
        dq, dk, dv = _add(dq, dq_p, q_part, 1), _add(dk, dk_p, k_part, 1), _add(dv, dv_p, k_part, 1)
    return dq, dk, dv


def _attend_backward(axis: tuple[str, ...], shards: int, scale: float, window: int | None,
                     saved: tuple[Any, ...], cotangent: jax.Array) -> tuple[Any, ...]:
    q, k, v, index, segments, result, logsumexp = saved
    groups = k.shape[2]
    qg = _grouped(q, groups)
    grad = _grouped(cotangent, groups).astype(jnp.float32)
    dot = jnp.einsum("btgnd,btgnd->bgnt", grad, _grouped(result, groups).astype(jnp.float32))
    unfold = functools.partial(_unfold, qg=qg, index=index, segments=segments, logsumexp=logsumexp, grad=grad,
                               dot=dot, scale=scale, window=window)
    keys = (k, v, index, segments)
    grads: tuple[jax.Array, ...] = (jnp.zeros(qg.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                                    jnp.zeros(v.shape, jnp.float32))
    grads = unfold(_OWN if shards > 1 else _ONE_BLOCK, grads, keys=keys)
    if shards > 1:  # the keys' gradients travel with them
        device = jax.lax.axis_index(axis)

        def step(number: jax.Array, state: tuple[Any, Keys]) -> tuple[Any, Keys]:
            (dq, dk, dv), keys = state
            keys, (dk, dv) = _shift((keys, (dk, dv)), axis, shards)
            grads = jax.lax.cond(_from_earlier(shards, number, device),
                                 lambda g, k: unfold(_FROM_EARLIER, g, keys=k),
                                 lambda g, k: unfold(_FROM_LATER, g, keys=k), (dq, dk, dv), keys)
            return grads, keys

        grads, _ = jax.lax.fori_loop(1, shards, step, (grads, keys))
        grads = (grads[0], *_shift(grads[1:], axis, shards))  # after the n-th shift they are home
    dq, dk, dv = grads
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None)


_attend.defvjp(_forward, _attend_backward)
