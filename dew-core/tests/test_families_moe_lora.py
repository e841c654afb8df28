"""LoRA on the mixture-of-experts families: the routed experts' stacked weights get adapters.

A routed-experts block keeps its experts' weights stacked [E, in, out] and multiplies them in a
grouped matmul that qwix never sees, so LoRA used to leave them alone without a word (a target
naming the block adapted its router only, and ``"mlp"`` matched no MoE layer). Here each expert
gets its own pair A [E, in, r], B [E, r, out]; the adapted model must compute exactly what the
base model computes on weights merged by hand in numpy (W + alpha / r * A @ B, expert by
expert), and ``merge_lora`` must produce those weights. What cannot carry them is refused in
one line: PEFT export, a quantized (QLoRA) base; a dropout is refused by Lora itself.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("qwix")

from dew.adapters.lora import Lora, LoraError, apply_lora, merge_lora, with_base  # noqa: E402
from dew.families.examples import write_checkpoint  # noqa: E402  (needs transformers)
from dew.pretrained import NoExactCounterpartError, Pretrained  # noqa: E402
from dew.testing.adapters import drawn_adapters  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, 300, (2, 12)).astype(np.int32)
SPEC = Lora(rank=2, alpha=6.0, targets=("mlp",))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Pretrained:
    return Pretrained.load(write_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), seed=3, redrawn=True))


@pytest.fixture(scope="module")
def adapted_mixtral(mixtral) -> tuple[object, dict]:
    return _adapted_variables(mixtral, SPEC)


def _adapted_variables(loaded: Pretrained, spec: Lora) -> tuple[object, dict]:
    """The adapted model and its variables on loaded's base, every adapter drawn away from zero."""
    return drawn_adapters(loaded.model, loaded.variables, spec, scale=0.1)


def _merged_by_hand(params: dict, scale: float, *, experts: bool = True) -> dict:
    """params with every adapter's product added into its weight, in numpy (no adapters left)."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = _merged_by_hand(value, scale, experts=experts)
        elif not key.endswith(("_lora_a", "_lora_b")):
            weight = np.asarray(value, np.float64)
            if f"{key}_lora_a" in params:
                a = np.asarray(params[f"{key}_lora_a"], np.float64)
                b = np.asarray(params[f"{key}_lora_b"], np.float64)
                if key in ("wi", "wi_gate", "wo") and a.ndim == 3:  # [E, in, r] @ [E, r, out], expert by expert
                    delta = np.stack([a[e] @ b[e] for e in range(a.shape[0])]) * experts
                else:
                    delta = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
                weight = weight + scale * delta.reshape(weight.shape)
            out[key] = weight.astype(np.float32)
    return out


@pytest.mark.slow
def test_mlp_targets_adapt_every_expert_with_its_own_pair_and_merge_exactly(mixtral, adapted_mixtral):
    adapted, variables = adapted_mixtral
    params = variables["params"]
    experts = mixtral.model.experts
    for layer in range(mixtral.model.num_layers):
        moe = params[f"layers_{layer}"]["moe"]
        for name in ("wi", "wi_gate", "wo"):
            e, inputs, outputs = moe[name].shape
            assert e == experts
            assert moe[f"{name}_lora_a"].shape == (experts, inputs, SPEC.rank)
            assert moe[f"{name}_lora_b"].shape == (experts, SPEC.rank, outputs)
        assert not any(key.endswith("_lora_a") for key in params[f"layers_{layer}"]["attention"])

    ours = np.asarray(jax.jit(adapted.apply)(variables, jnp.asarray(TOKENS)))
    scale = SPEC.alpha / SPEC.rank
    by_hand = {"params": _merged_by_hand(params, scale)}
    base_apply = jax.jit(mixtral.model.apply)  # compiled once, for both weights below
    expected = np.asarray(base_apply(by_hand, jnp.asarray(TOKENS)))
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)
    # The experts' adapters matter: without their deltas the logits move.
    no_experts = {"params": _merged_by_hand(params, scale, experts=False)}
    assert np.abs(np.asarray(base_apply(no_experts, jnp.asarray(TOKENS))) - ours).max() > 1e-3

    merged = merge_lora(variables, SPEC)
    flat_merged = dict(jax.tree_util.tree_leaves_with_path(merged))
    flat_hand = dict(jax.tree_util.tree_leaves_with_path(by_hand))
    assert flat_merged.keys() == flat_hand.keys()
    for path, value in flat_hand.items():
        np.testing.assert_allclose(np.asarray(flat_merged[path]), value, atol=1e-6, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("rank", [4, 16])
def test_a_router_or_shared_gate_narrower_than_the_rank_stays_as_trained(tmp_path, rank):
    """Qwen 2 MoE's router is as wide as its 8 experts and its shared gate one column: adapting
    them with the rest of the block refused every rank above 1. Each is adapted where the rank fits
    it (the router at rank 4, as runs trained before kept them) and stays as trained where it does
    not; the adapted model is the base one with every adapter it has merged by hand."""
    qwen = Pretrained.load(write_checkpoint("qwen2_moe", tmp_path / "qwen2_moe", seed=4, redrawn=True))
    spec = Lora(rank=rank, alpha=8.0, targets=("mlp",))
    adapted, variables = _adapted_variables(qwen, spec)
    routed = next(i for i in range(qwen.model.num_layers) if i not in qwen.model.dense_layers)
    moe = variables["params"][f"layers_{routed}"]["moe"]
    assert {"wi_lora_a", "wo_lora_a", "wi_gate_lora_a"} <= set(moe) and "wi_lora_a" in moe["shared"]
    assert ("router_lora_a" in moe) == (rank <= qwen.model.experts) and "shared_gate_lora_a" not in moe
    ours = np.asarray(jax.jit(adapted.apply)(variables, jnp.asarray(TOKENS)))
    by_hand = {"params": _merged_by_hand(variables["params"], spec.alpha / spec.rank)}
    np.testing.assert_allclose(ours, np.asarray(jax.jit(qwen.model.apply)(by_hand, jnp.asarray(TOKENS))),
                               atol=2e-5, rtol=0)


def test_what_cannot_carry_expert_adapters_refuses_in_one_line(mixtral, adapted_mixtral, tmp_path):
    from dew.pretrained.peft import save_adapters

    _, variables = adapted_mixtral
    with pytest.raises(NoExactCounterpartError, match=r"layers_0/moe/wi.* have LoRA adapters that no PEFT LoRA module .*routed experts.*"
                       r"dew does not write PEFT's layout for experts' fused parameters \(target_parameters\)") as refused:
        save_adapters(tmp_path / "adapters", mixtral.model, variables, SPEC)
    assert "\n" not in str(refused.value) and "merged" in str(refused.value)
    assert not (tmp_path / "adapters").exists()
    # Qwen 3 MoE names each expert's Linears *_proj: they were taken for one PEFT module each, the
    # refusal named the routers alone, and without router adapters the experts were written under
    # the last expert's name with the stack's shape.
    qwen = Pretrained.load(write_checkpoint("qwen3_moe", tmp_path / "qwen3_moe", seed=3, redrawn=True))
    _, adapted = _adapted_variables(qwen, SPEC)
    with pytest.raises(NoExactCounterpartError, match=r"moe/wi.* have LoRA adapters that no PEFT LoRA module .*routed experts"):
        save_adapters(tmp_path / "qwen-adapters", qwen.model, adapted, SPEC)
    assert not (tmp_path / "qwen-adapters").exists()

    dummy = jnp.zeros((1, 4), jnp.int32)
    spec = Lora(rank=2, targets=("mlp",), base="int8")
    with pytest.raises(LoraError, match=r"moe/wi .*routed-experts.*float") as refused:
        jax.eval_shape(lambda: apply_lora(mixtral.model, spec).init(jax.random.key(0), dummy))
    # dew's one line, to which JAX, raising it through eval_shape, may append its note on filtered frames
    said = str(refused.value).partition("\n--------------------\nFor simplicity, JAX")[0]
    assert "\n" not in said and said.endswith(" (in a recipe, lora.base=float32 or lora.targets=[attention]).")
    # A dropout on the adapters, which no training step draws a key for, is refused where it is written.
    with pytest.raises(LoraError, match=r"^Lora\.dropout=0\.1 is not applied by dew.*Set lora\.dropout to 0") as refused:
        Lora(rank=2, targets=("mlp",), dropout=0.1)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_adapters_on_modules_peft_reads_as_routed_experts_are_refused(tmp_path):
    """DeepSeek-V3's dense first layer and shared experts name their Linears gate/up/down_proj, which
    PEFT (with transformers 5) rewrites into the routed experts' fused parameters: their adapters were
    written, PEFT loaded none of them without an error, and the PEFT model computed the base there."""
    from dew.pretrained.peft import ADAPTER_CONFIG, save_adapters

    loaded = Pretrained.load(write_checkpoint("deepseek_v3", tmp_path / "base", seed=1, redrawn=True))
    for targets, module in (((r".*layers_0/mlp",), "model.layers.0.mlp.down_proj"),
                            ((r".*/moe/shared",), "model.layers.1.mlp.shared_experts.down_proj")):
        spec = Lora(rank=2, alpha=4.0, targets=targets)
        _, variables = drawn_adapters(loaded.model, loaded.variables, spec, scale=0.1)
        with pytest.raises(NoExactCounterpartError, match=rf"{module}, .* PEFT reads the target names .*down_proj"
                                                          r".* of a deepseek_v3 model as its routed experts") as refused:
            save_adapters(tmp_path / "adapters", loaded.model, variables, spec)
        assert "\n" not in str(refused.value) and "merged" in str(refused.value)
        assert not (tmp_path / "adapters").exists()
    spec = Lora(rank=2, alpha=4.0, targets=("attention",))  # attention's names PEFT leaves alone: written
    _, variables = drawn_adapters(loaded.model, loaded.variables, spec, scale=0.1)
    save_adapters(tmp_path / "adapters", loaded.model, variables, spec)
    assert (tmp_path / "adapters" / ADAPTER_CONFIG).is_file()


@pytest.mark.slow
def test_mlp_reaches_the_routed_and_shared_experts_of_a_model_with_a_dense_first_layer(tmp_path):
    loaded = Pretrained.load(write_checkpoint("deepseek_v3", tmp_path / "base", seed=1, redrawn=True))
    adapted = apply_lora(loaded.model, Lora(rank=2, targets=("mlp",)))
    abstract = jax.eval_shape(lambda: adapted.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    params = nn.meta.unbox(abstract)["params"]
    assert "wi_lora_a" in params["layers_0"]["mlp"]  # the dense first layer
    routed = [key for key in params if key.startswith("layers_") and "moe" in params[key]]
    assert routed
    for layer in routed:
        moe = params[layer]["moe"]
        assert moe["wi_lora_a"].shape[0] == loaded.model.experts
        assert "wi_lora_a" in moe["shared"]


@pytest.mark.slow
def test_a_scanned_stack_adapts_its_experts_as_the_numbered_layers_do(mixtral, adapted_mixtral):
    adapted, variables = adapted_mixtral
    ours = np.asarray(jax.jit(adapted.apply)(variables, jnp.asarray(TOKENS)))
    stack = mixtral.model.clone(scan_layers=True)
    scanned = apply_lora(stack, SPEC)
    fresh = nn.meta.unbox(scanned.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    layers, experts = mixtral.model.num_layers, mixtral.model.experts
    assert fresh["params"]["layers"]["moe"]["wo_lora_b"].shape[:3] == (layers, experts, SPEC.rank)
    stacked = with_base(fresh, variables)  # the numbered layers' adapters, stacked
    np.testing.assert_array_equal(np.asarray(jax.jit(scanned.apply)(stacked, jnp.asarray(TOKENS))), ours)
    merged = np.asarray(jax.jit(stack.apply)(merge_lora(stacked, SPEC), jnp.asarray(TOKENS)))
    np.testing.assert_allclose(merged, ours, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_training_the_adapters_moves_every_experts_pair(mixtral):
    import optax

    from dew import Trainer
    from dew.adapters.lora import adapters_only
    from dew.data import Dataset
    from dew.testing.doubles import NextToken

    # The cross entropy alone (the routers' balance and z terms reach no adapter B).
    adapted = apply_lora(mixtral.model, SPEC)
    windows = Dataset(train=lambda partition: iter(
        lambda: {"text": np.random.default_rng(0).integers(0, 300, (2, 9)).astype(np.int32)}, None), batch=2)
    state = Trainer(adapters_only(NextToken(model=adapted, seq_len=8)), optax.adam(1e-2),
                    key=jax.random.key(0)).fit(windows, steps=2, log_every=2)
    moe = nn.meta.unbox(state.params)["params"]["layers_0"]["moe"]
    for name in ("wi", "wi_gate", "wo"):  # B starts at zero: a gradient reached every expert's own B
        moved = np.abs(np.asarray(moe[f"{name}_lora_b"])).reshape(mixtral.model.experts, -1).max(axis=1)
        assert (moved > 0).all(), (name, moved)
