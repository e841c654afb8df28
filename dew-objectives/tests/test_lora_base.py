"""LoRA's base: quantized (QLoRA, int8 and nf4), and read from an init (a Pretrained directory, another run)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer, models
from dew.adapters.lora import (
    BaseWeights,
    Lora,
    LoraError,
    adapters_only,
    apply_lora,
    base_model,
    is_adapter,
    with_base,
)
from dew.data import Dataset
from dew.objectives.lm import LMObjective
from dew.pretrained import Pretrained
from dew.training import trees
from dew.training.initializers import ParamsFrom

pytest.importorskip("qwix")

SEQ = 8


def llama_like():
    return models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
                        mlp_features=32, max_seq_len=16, position_embedding="rotary", mlp_activation="swiglu")


def windows(rows=4):
    def batches():
        index = 0
        while True:
            yield {"text": np.random.default_rng(index).integers(0, 32, (rows, SEQ + 1)).astype(np.int32)}
            index += 1

    return Dataset(train=lambda partition: batches(), batch=rows)


def tokens():
    return jax.random.randint(jax.random.key(3), (2, SEQ), 0, 32)


def leaf(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return tree


@pytest.fixture(scope="module")
def float_base():
    model = llama_like()
    return model, nn.meta.unbox(model.init(jax.random.key(1), jnp.zeros((1, SEQ), jnp.int32)))


def adapted(model, base, spec):
    wrapped = apply_lora(model, spec)
    fresh = wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    return wrapped, with_base(fresh, base)


def test_an_int8_base_holds_channel_codes_and_computes_with_them(float_base):
    model, base = float_base
    wrapped, variables = adapted(model, base, Lora(rank=2, targets=("attention", "mlp"), base="int8"))
    dequantized = jax.tree.map(lambda x: x, base)
    for path in ("layers_0/attention/query", "layers_0/attention/key", "layers_0/attention/value",
                 "layers_0/attention/out", "layers_0/mlp/wi", "layers_0/mlp/wi_gate", "layers_0/mlp/wo"):
        held = leaf(variables["params"], path).array
        codes, scale = np.asarray(held.qvalue), np.asarray(held.scale)
        weight = np.asarray(leaf(base["params"], path))
        assert codes.dtype == np.int8
        # An independent reading of the codes: code * scale, within half a step of the float weight.
        values = codes.astype(np.float32) * scale
        assert np.all(np.abs(values - weight) <= scale / 2 + 1e-7)
        node = leaf(dequantized["params"], path.rsplit("/", 1)[0])
        node[path.rsplit("/", 1)[1]] = values
    # At the start (B = 0) the adapted model is the base model on the dequantized weights.
    np.testing.assert_allclose(np.asarray(jax.jit(wrapped.apply)(variables, tokens())),
                               np.asarray(model.apply(dequantized, tokens())), atol=1e-5, rtol=1e-5)


def test_an_nf4_base_holds_sixteen_levels_near_the_float_weights(float_base):
    from qwix._src.core import qarray

    model, base = float_base
    wrapped, variables = adapted(model, base, Lora(rank=2, targets=("attention", "mlp"), base="nf4"))
    held = leaf(variables["params"], "layers_0/mlp/wi").array
    assert len(np.unique(np.asarray(held.qvalue))) <= 16
    weight = np.asarray(base["params"]["layers_0"]["mlp"]["wi"])
    values = np.asarray(qarray.dequantize(held))
    # NF4's widest gap is 0.30 of a channel's largest magnitude: every value lies within half of it.
    assert np.all(np.abs(values - weight) <= 0.16 * np.abs(weight).max(axis=0, keepdims=True))
    # It computes with those values: the base model on the dequantized weights, at the start.
    dequantized = jax.tree.map(lambda x: x, base)
    for module, names in (("attention", ("query", "key", "value", "out")), ("mlp", ("wi", "wi_gate", "wo"))):
        for name in names:
            dequantized["params"]["layers_0"][module][name] = qarray.dequantize(
                leaf(variables["params"], f"layers_0/{module}/{name}").array)
    np.testing.assert_allclose(np.asarray(jax.jit(wrapped.apply)(variables, tokens())),
                               np.asarray(model.apply(dequantized, tokens())), atol=1e-5, rtol=1e-5)


# The 16 NormalFloat levels of the QLoRA paper (Dettmers et al. 2023, appendix E), as bitsandbytes lists them.
NF4_LEVELS = np.asarray([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                         -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                         0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                         0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


def nf4_blocks(weight, block):
    """The paper's blockwise NF4 of weight [..., inputs, outputs]: each run of block inputs of an
    output scaled by its absmax, rounded to the nearest level, scaled back."""
    *lead, inputs, outputs = weight.shape
    blocks = weight.reshape(*lead, inputs // block, block, outputs)
    absmax = np.abs(blocks).max(axis=-2, keepdims=True)
    normalized = blocks / absmax
    nearest = NF4_LEVELS[np.abs(normalized[..., None] - NF4_LEVELS).argmin(axis=-1)]
    return (nearest * absmax).reshape(weight.shape)


def test_an_nf4_base_in_blocks_is_the_papers_blockwise_normal_float(float_base):
    from qwix._src.core import qarray

    model, base = float_base
    spec = Lora(rank=2, targets=("attention", "mlp"), base="nf4", block_size=8)
    wrapped, variables = adapted(model, base, spec)
    _, channelwise = adapted(model, base, Lora(rank=2, targets=("attention", "mlp"), base="nf4"))
    for path in ("layers_0/attention/query", "layers_0/mlp/wi", "layers_0/mlp/wo"):
        weight = np.asarray(leaf(base["params"], path))
        flat = weight.reshape(weight.shape[0], -1)  # a projection's inputs first, its outputs after
        expected = nf4_blocks(flat, 8).reshape(weight.shape)
        held = np.asarray(qarray.dequantize(leaf(variables["params"], path).array))
        np.testing.assert_allclose(held, expected, atol=1e-6)
        per_channel = np.asarray(qarray.dequantize(leaf(channelwise["params"], path).array))
        assert np.abs(held - weight).mean() < np.abs(per_channel - weight).mean()
    # the output projection's inputs are its heads' features: blocks of the head size
    out = np.asarray(leaf(base["params"], "layers_0/attention/out"))  # [heads, head size, outputs]
    held = np.asarray(qarray.dequantize(leaf(variables["params"], "layers_0/attention/out").array))
    np.testing.assert_allclose(held, nf4_blocks(out.reshape(-1, out.shape[-1]), 16).reshape(out.shape), atol=1e-6)
    with pytest.raises(LoraError, match=r"block_size=5 does not divide the inputs of adapted weights such as "
                                        r"layers_0/attention/(query|key|value) \(16, 2, 8\)"):
        adapted(model, base, Lora(rank=2, targets=("attention",), base="nf4", block_size=5))
    with pytest.raises(LoraError, match="set lora.base to nf4 or int8"):
        Lora(block_size=64)


@pytest.mark.slow
def test_qlora_trains_the_adapters_alone_and_keeps_the_codes_bitwise(float_base):
    model, base = float_base
    spec = Lora(rank=2, alpha=4.0, targets=("attention", "mlp"), base="int8")
    wrapped = apply_lora(model, spec)
    objective = adapters_only(LMObjective(model=wrapped, seq_len=SEQ))
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), initializer=base).fit(
        windows(), steps=3, log_every=3)
    start = with_base(nn.meta.unbox(wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))), base)
    final = jax.device_get(nn.meta.unbox(state.params))
    flat_start = dict(jax.tree_util.tree_flatten_with_path(start)[0])
    changed = [jax.tree_util.keystr(path) for path, value in jax.tree_util.tree_flatten_with_path(final)[0]
               if not np.array_equal(np.asarray(value), np.asarray(flat_start[path]))]
    assert changed and all("_lora_" in path for path in changed)
    assert any("_lora_b" in path for path in changed)
    adapters = sum(np.size(x) for x in jax.tree.leaves(trees.select(final, is_adapter)))
    assert sum(np.size(x) for x in jax.tree.leaves(state.opt_state) if np.ndim(x)) == 2 * adapters
    # The adapted weights are stored in a quarter of their float bytes (plus one scale per channel).
    held = leaf(final["params"], "layers_0/mlp/wi")
    assert np.asarray(held.array.qvalue).nbytes * 4 == np.asarray(base["params"]["layers_0"]["mlp"]["wi"]).nbytes


@pytest.mark.slow
def test_a_pretrained_directory_is_the_base_under_fresh_adapters(float_base, tmp_path):
    model, base = float_base
    Pretrained(model, base).save(tmp_path / "base")
    loaded = Pretrained.load(tmp_path / "base")
    wrapped = apply_lora(model, Lora(rank=2, targets=("attention", "mlp")))
    trainer = Trainer(adapters_only(LMObjective(model=wrapped, seq_len=SEQ)), optax.adam(1e-2),
                      key=jax.random.key(0), initializer=dict(loaded.variables))
    state, _, _ = trainer.place()
    params = jax.device_get(nn.meta.unbox(state.params))
    for path in trees.paths(loaded.variables):
        np.testing.assert_array_equal(np.asarray(leaf(params, path)), np.asarray(leaf(loaded.variables, path)))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(
        trees.select(params, lambda path, _: path[-1].endswith("_lora_b"))))
    np.testing.assert_array_equal(np.asarray(wrapped.apply(params, tokens())),
                                  np.asarray(model.apply(loaded.variables, tokens())))
    assert base_model(wrapped) is model


@pytest.mark.slow
def test_another_runs_parameters_are_the_base(float_base, tmp_path):
    model, _ = float_base
    plain = Trainer(LMObjective(model=model, seq_len=SEQ), optax.adam(1e-2), key=jax.random.key(5),
                    checkpoints=Checkpoints(tmp_path / "plain"))
    trained = jax.device_get(nn.meta.unbox(plain.fit(windows(), steps=2, log_every=2).params))
    wrapped = apply_lora(model, Lora(rank=2, targets=("attention",), base="int8"))
    trainer = Trainer(adapters_only(LMObjective(model=wrapped, seq_len=SEQ)), optax.adam(1e-2),
                      key=jax.random.key(0), initializer=BaseWeights(ParamsFrom(tmp_path / "plain")))
    params = jax.device_get(nn.meta.unbox(trainer.place()[0].params))
    np.testing.assert_array_equal(np.asarray(params["params"]["layers_0"]["mlp"]["wi"]),
                                  np.asarray(trained["params"]["layers_0"]["mlp"]["wi"]))
    query = params["params"]["layers_0"]["attention"]["query"].array
    weight = np.asarray(trained["params"]["layers_0"]["attention"]["query"])
    assert np.all(np.abs(np.asarray(query.qvalue) * np.asarray(query.scale) - weight)
                  <= np.asarray(query.scale) / 2 + 1e-7)


def test_a_base_lacking_a_weight_is_refused_naming_it(float_base):
    model, base = float_base
    wrapped = apply_lora(model, Lora(rank=2))
    fresh = wrapped.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    partial = {"params": {k: v for k, v in base["params"].items() if k != "final_norm"}}
    with pytest.raises(LoraError, match="lack 1 base weight.*params/final_norm/scale"):
        with_base(fresh, partial)
    wrong = jax.tree.map(lambda x: x, base)
    wrong["params"]["layers_0"]["attention"]["query"] = np.zeros((16, 2, 4), np.float32)
    with pytest.raises(LoraError, match=r"params/layers_0/attention/query has shape \(16, 2, 4\)"):
        with_base(fresh, wrong)
