"""CausalTransformer: logical axis names on every parameter, and a cached decode path."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.nn import sharding
from dew.nn.backbones import CausalTransformer
from dew.registry import InvalidFieldsError

TINY = dict(vocab_size=23, emb_features=16, num_layers=2, num_heads=4, mlp_features=32,
            max_seq_len=24)
VARIANTS = {
    "learned-gelu-untied": {},
    "rotary-swiglu-tied": dict(position_embedding="rotary", mlp_activation="swiglu",
                               tie_embeddings=True),
}


def build(**overrides) -> CausalTransformer:
    return CausalTransformer(**{**TINY, **overrides})


def test_registry_builds_the_same_module():
    model = models.build("causal_transformer", vocab_size=257, emb_features=64, num_layers=2,
                         num_heads=4, mlp_features=256, max_seq_len=128)
    assert type(model) is CausalTransformer
    assert model == CausalTransformer(257, 64, 2, 4, 256, 128)


def test_registry_rejects_a_misspelt_field():
    with pytest.raises(InvalidFieldsError, match="num_head"):
        models.build("causal_transformer", **{**TINY, "num_head": 4})


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_names_its_logical_axes(variant):
    model = build(**VARIANTS[variant])
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    boxes = jax.tree_util.tree_leaves(
        abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    allowed = set(sharding.PARAMETER_AXES) | {None}
    for box in boxes:
        assert len(box.names) == box.value.ndim
        assert set(box.names) <= allowed
    specs = nn.get_partition_spec(abstract)["params"]
    assert specs["embed"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
    assert specs["layers_1"]["attention"]["query"] == jax.sharding.PartitionSpec(
        "embed", "heads", "kv")
    assert specs["layers_0"]["mlp"]["wo"] == jax.sharding.PartitionSpec("mlp", "embed")
    if model.tie_embeddings:
        assert "head" not in specs
    else:
        assert specs["head"] == jax.sharding.PartitionSpec("embed", "vocab")


def test_param_refuses_names_that_do_not_match_the_shape():
    class Wrong(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * sharding.param(self, "w", nn.initializers.ones, (3, 3), ("embed",))

    with pytest.raises(ValueError, match=r"shape \(3, 3\) but 1 axis names"):
        Wrong().init(jax.random.key(0), jnp.ones((3, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decode_matches_the_full_forward_at_every_position(variant):
    model = build(**VARIANTS[variant])
    variables = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, TINY["vocab_size"])
    full = jax.jit(model.apply)(variables, tokens)

    @jax.jit
    def decode(variables, tokens):
        return model.apply(variables, tokens, decode=True, mutable=["cache"])

    prefix = 4  # a prefill of 4 tokens, then one token at a time
    logits, cache = decode(variables, tokens[:, :prefix])
    pieces = [logits]
    for t in range(prefix, tokens.shape[1]):
        logits, cache = decode({**variables, **cache}, tokens[:, t : t + 1])
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache["cache"]["index"], [12, 12, 12])
    # The cache is sized by max_seq_len, whatever the prompt length.
    assert cache["cache"]["layers_0"]["attention"]["cached_key"].shape == (3, 24, 4, 4)


def test_logits_are_float32_with_bfloat16_compute():
    model = build(dtype=jnp.bfloat16)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    hidden = nn.meta.unbox(variables)["params"]["layers_0"]["attention"]["query"]
    assert hidden.dtype == jnp.float32  # stored in param_dtype
    logits = jax.eval_shape(model.apply, variables, jnp.zeros((2, 5), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 5, 23)


def test_bad_configuration_and_inputs_fail_clearly():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        build(emb_features=18).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    model = build()
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="longer than max_seq_len=24"):
        jax.eval_shape(model.apply, variables, jnp.zeros((1, 25), jnp.int32))


@pytest.mark.slow
def test_logical_names_shard_on_a_mesh(python_in_subprocess):
    """Under a 2x2 mesh with rules in context the sharded model computes the same logits."""
    out = python_in_subprocess("""
        import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding
        from dew.nn.backbones import CausalTransformer
        rules = (("batch", "data"), ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"),
                 ("heads", "tensor"), ("kv", None), ("activation_heads", "tensor"),
                 ("activation_mlp", "tensor"), ("activation_vocab", "tensor"))
        model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=2, num_heads=4,
                                  mlp_features=32, max_seq_len=16)
        tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 32)
        init = lambda key: model.init(key, jnp.zeros((1, 16), jnp.int32))
        reference = jax.jit(model.apply)(nn.meta.unbox(jax.jit(init)(jax.random.key(0))), tokens)
        mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
        with mesh, nn.logical_axis_rules(rules):
            specs = nn.get_partition_spec(jax.eval_shape(init, jax.random.key(0)))
            shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
            variables = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
            kernel = variables["params"]["layers_0"]["mlp"]["wi"].value
            assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor"), kernel.sharding
            logits = jax.jit(lambda v, t: model.apply(nn.meta.unbox(v), t))(variables, tokens)
        np.testing.assert_allclose(logits, reference, atol=1e-5)
        print("ok")
    """, devices=4)
    assert out.strip().endswith("ok")
