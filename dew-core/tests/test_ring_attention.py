"""Ring attention (dew.nn.ring_attention) computes plain causal attention: on 8 fake CPU devices in a
subprocess, its outputs and gradients with the positions split over the sequence axis (2 and 4
devices, beside fsdp and tensor) equal a hand-written softmax over the whole sequence, with packed
documents, grouped key/value heads, a sliding window and a query scale; its program passes keys and
values with collective permutes and gathers none. On one device it is the einsum form."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.layers import CausalSelfAttention
from dew.nn.ring_attention import RingAttentionError, zigzag_order

PROGRAM = r"""
import json, re
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dew.nn.layers import CausalSelfAttention, FusedAttentionError
from dew.nn.ring_attention import ring_attention
from dew.nn.sharding import SequenceSplitError
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec, build_mesh

jax.config.update("jax_default_matmul_precision", "highest")

def plain(q, k, v, segments, scale, window):
    # softmax(q k^T * scale) v over the whole row, written out: causal, within a document, within window.
    b, t, h, d = q.shape
    share = h // k.shape[2]
    k, v = np.repeat(k, share, axis=2), np.repeat(v, share, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    i = np.arange(t)
    seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (window or t))
    seen = seen[None, None] & (segments[:, None, :, None] == segments[:, None, None, :])
    scores = np.where(seen, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", weights / weights.sum(-1, keepdims=True), v)

def plain_grads(q, k, v, segments, scale, window, probe):
    f = lambda q, k, v: jnp.sum(probe * plain_jnp(q, k, v, segments, scale, window))
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

def plain_jnp(q, k, v, segments, scale, window):
    b, t, h, d = q.shape
    share = h // k.shape[2]
    k, v = jnp.repeat(k, share, axis=2), jnp.repeat(v, share, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    i = jnp.arange(t)
    seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (window or t))
    seen = seen[None, None] & (segments[:, None, :, None] == segments[:, None, None, :])
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), -1), v)

rng = np.random.default_rng(0)
B, T, D = 8, 32, 8
rules = Layout().axis_rules
CASES = {  # mesh, query heads, key/value heads, scale, window
    "sequence2": ({"sequence": 2}, 4, 2, None, None),
    "sequence4": ({"sequence": 4}, 4, 2, None, None),
    "sequence4_fsdp2_window": ({"sequence": 4, "fsdp": 2}, 4, 4, 0.5, 5),
    "sequence2_fsdp2_tensor2": ({"sequence": 2, "fsdp": 2, "tensor": 2}, 4, 2, None, None),
}
out = {}
for name, (spec, heads, kv, scale, window) in CASES.items():
    q = rng.standard_normal((B, T, heads, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, kv, D)).astype(np.float32) for _ in range(2))
    probe = rng.standard_normal((B, T, heads, D)).astype(np.float32)
    # Packed documents: every row cut into 1 to 5 documents at random places.
    segments = np.cumsum(rng.random((B, T)) < 0.12, axis=1).astype(np.int32) + 1
    mesh = build_mesh(MeshSpec(**spec))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        heads_spec = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence", "tensor"))
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
        args = [jax.device_put(a, heads_spec) for a in (q, k, v, probe)] + [jax.device_put(segments, rows)]

        def loss(q, k, v, probe, segments):
            result = ring_attention(q, k, v, segments, scale=scale, window=window)
            return jnp.sum(probe * result), result

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(*args).compile()
        (_, result), grads = step(*args)
        text = step.as_text()
    want = plain(q, k, v, segments, scale or D ** -0.5, window)
    want_grads = plain_grads(q, k, v, segments, scale or D ** -0.5, window, probe)
    out[name] = {
        "output": float(np.abs(np.asarray(result) - want).max()),
        "grads": max(float(np.abs(np.asarray(g) - np.asarray(w)).max()) for g, w in zip(grads, want_grads)),
        "spec": str(result.sharding.spec),
        "collectives": sorted(set(re.findall(r"(all-gather|collective-permute|all-to-all)", text))),
        "documents": int(segments.max()),
    }

# The layer: attention="ring" is attention="einsum" with the positions split four ways, and the
# einsum form gathers keys and values where the ring passes them on.
mesh = build_mesh(MeshSpec(sequence=4))
x = rng.standard_normal((B, T, 16)).astype(np.float32)
positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
segments = np.cumsum(rng.random((B, T)) < 0.12, axis=1).astype(np.int32)
layers = {}
variables = CausalSelfAttention(4, 8, T, rotary=True, num_kv_heads=2).init(jax.random.key(0), x[:1, :8],
                                                                          positions[:1, :8])
with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
    inputs = [jax.device_put(a, rows) for a in (x, positions, segments)]
    for kind in ("einsum", "ring"):
        layer = CausalSelfAttention(4, 8, T, rotary=True, num_kv_heads=2, attention=kind)
        apply = jax.jit(lambda v, x, p, s, layer=layer: layer.apply(v, x, p, segment_ids=s))
        compiled = apply.lower(variables, *inputs).compile()
        layers[kind] = (np.asarray(compiled(variables, *inputs)), "all-gather" in compiled.as_text())
    try:
        ring_attention(*(jnp.zeros((2, 12, 2, 4)),) * 3)
    except SequenceSplitError as error:
        out["split_error"] = str(error)
    # cuDNN's fused kernel takes whole sequences: refused by name, not at its partitioner on a GPU.
    cudnn = CausalSelfAttention(4, 8, T, rotary=True, num_kv_heads=2, attention="cudnn", dtype=jnp.bfloat16)
    try:
        jax.jit(lambda v, x, p: cudnn.apply(v, x, p)).lower(variables, *inputs[:2])
    except FusedAttentionError as error:
        out["cudnn_error"] = str(error)
out["layer"] = float(np.abs(layers["ring"][0] - layers["einsum"][0]).max())
out["gathers"] = {kind: gathered for kind, (_, gathered) in layers.items()}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_ring_attention_on_the_sequence_axis_is_plain_attention(python_in_subprocess):
    stdout = python_in_subprocess(PROGRAM, devices=8, timeout=600)
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT"))[6:])
    for name in ("sequence2", "sequence4", "sequence4_fsdp2_window", "sequence2_fsdp2_tensor2"):
        case = result[name]
        assert case["output"] <= 1e-5 and case["grads"] <= 1e-5, (name, case)
        assert case["documents"] > 1, case  # packed rows really were packed
        assert "'sequence'" in case["spec"], case  # the output stays split over the sequence axis
        # Keys and values pass from device to device; nothing gathers them.
        assert case["collectives"] == ["collective-permute"], (name, case)
    assert result["layer"] <= 1e-5, result["layer"]
    assert result["gathers"] == {"einsum": True, "ring": False}
    assert "12 positions" in result["split_error"] and "multiple of 8" in result["split_error"]
    assert "attention='cudnn' cannot run with the sequence split over mesh axes ('sequence',)" in result["cudnn_error"]


def test_zigzag_order_gives_each_shard_a_head_and_a_tail_chunk():
    order = zigzag_order(16, 4)  # 8 chunks of 2: shard i holds chunks i and 7 - i
    assert order.reshape(4, 2, 2)[:, :, 0].tolist() == [[0, 14], [2, 12], [4, 10], [6, 8]]
    assert sorted(order.tolist()) == list(range(16))
    # Every shard has the same causal work: the sum of its chunks' indices is the same.
    assert len({int(row.sum()) for row in order.reshape(4, 4)}) == 1


@pytest.mark.slow
def test_ring_attention_on_one_device_is_the_einsum_form():
    """Without a mesh the ring is one block: a layer's outputs and gradients match the einsum
    form's (an odd length, packed documents, grouped key/value heads), and soft-capped scores are
    refused by name."""
    kinds = dict(num_heads=4, head_features=8, max_len=24, rotary=True, num_kv_heads=2)
    x = jax.random.normal(jax.random.key(1), (3, 17, 16))
    positions = jnp.broadcast_to(jnp.arange(17, dtype=jnp.int32), (3, 17))
    segments = jnp.asarray(np.repeat([[1] * 9 + [2] * 8], 3, axis=0), jnp.int32)
    einsum, ring = CausalSelfAttention(**kinds), CausalSelfAttention(**kinds, attention="ring")
    variables = jax.jit(einsum.init)(jax.random.key(0), x, positions)

    @jax.jit
    def both(variables: dict) -> tuple:
        def loss(layer: CausalSelfAttention, variables: dict) -> tuple[jax.Array, jax.Array]:
            out = layer.apply(variables, x, positions, segment_ids=segments)
            return jnp.sum(jnp.sin(out)), out

        return tuple(jax.value_and_grad(functools.partial(loss, layer), has_aux=True)(variables)
                     for layer in (einsum, ring))

    ((_, want), want_grads), ((_, got), got_grads) = both(variables)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    capped = CausalSelfAttention(**kinds, attention="ring", softcap=30.0)
    with pytest.raises(RingAttentionError, match="softcap"):
        jax.eval_shape(capped.init, jax.random.key(0), x, positions)
