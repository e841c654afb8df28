"""RoutedExperts against transformers' own MoE blocks, against a per-token loop written here,
and its statistics against their formulas.

Every transformers block is built tiny in float32 with every weight redrawn (routers
sharp enough that choices are never near ties, a score-correction bias large enough
to change choices); dew's block takes the same weights and the same inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn

from dew.nn.experts import RoutedExperts, route
from dew.nn.grouped import SortedGroups
from dew.nn.moe import ExpertConfigError, moe_statistics

FEATURES, HIDDEN = 8, 6


def redraw(module: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    """Every parameter and buffer of module drawn again, far from its initial values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)


def tokens(seed: int, shape: tuple[int, ...] = (2, 5, FEATURES)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def experts_from(experts: torch.nn.Module) -> dict[str, np.ndarray]:
    """transformers' stacked experts (gate_up_proj [E, 2I, D], down_proj [E, D, I]) as dew's."""
    gate_up = experts.gate_up_proj.detach().numpy()
    half = gate_up.shape[1] // 2
    return {"wi_gate": gate_up[:, :half].transpose(0, 2, 1), "wi": gate_up[:, half:].transpose(0, 2, 1),
            "wo": experts.down_proj.detach().numpy().transpose(0, 2, 1)}


def mlp_from(mlp: torch.nn.Module) -> dict[str, np.ndarray]:
    return {"wi_gate": mlp.gate_proj.weight.detach().numpy().T, "wi": mlp.up_proj.weight.detach().numpy().T,
            "wo": mlp.down_proj.weight.detach().numpy().T}


def mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=FEATURES, intermediate_size=HIDDEN, num_local_experts=4,
                           num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(config).eval()
    redraw(block, 1)
    params = {"router": block.gate.weight.detach().numpy().T, **experts_from(block.experts)}
    return block, RoutedExperts(4, HIDDEN, 2), params


def qwen3_moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=FEATURES, moe_intermediate_size=HIDDEN, num_experts=6,
                            num_experts_per_tok=3, norm_topk_prob=False)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    redraw(block, 2)
    params = {"router": block.gate.weight.detach().numpy().T, **experts_from(block.experts)}
    return block, RoutedExperts(6, HIDDEN, 3, normalize_top_k=False), params


def qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=FEATURES, moe_intermediate_size=HIDDEN, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True, shared_expert_intermediate_size=10)
    block = Qwen2MoeSparseMoeBlock(config).eval()
    redraw(block, 3)
    params = {"router": block.gate.weight.detach().numpy().T, **experts_from(block.experts),
              "shared": mlp_from(block.shared_expert),
              "shared_gate": block.shared_expert_gate.weight.detach().numpy().T}
    return block, RoutedExperts(4, HIDDEN, 2, shared_features=10, shared_gate=True), params


def deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=FEATURES, moe_intermediate_size=HIDDEN, n_routed_experts=8,
                              num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    block = DeepseekV3MoE(config).eval()
    redraw(block, 4)
    params = {"router": block.gate.weight.detach().numpy().T, **experts_from(block.experts),
              "score_correction": block.gate.e_score_correction_bias.detach().numpy(),
              "shared": mlp_from(block.shared_experts)}
    dew = RoutedExperts(8, HIDDEN, 3, scoring="sigmoid", routed_scale=2.5, groups=4, groups_per_token=2,
                        score_correction=True, shared_features=2 * HIDDEN)
    return block, dew, params


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_block_computes_what_transformers_computes(family):
    hf_block, block, params = FAMILIES[family]()
    x = tokens(10)
    with torch.no_grad():
        expected = hf_block(torch.from_numpy(x)).numpy()
    variables = {"params": jax.tree.map(jnp.asarray, params)}
    # Every weight has its counterpart: the trees agree leaf for leaf in shape.
    fresh = nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(0), x))
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, variables)
    ways = {"dropless": block}
    if family == "deepseek_v3":  # every router option on the other paths too
        ways["ragged_dot"] = block.clone(grouped_matmul="ragged_dot")
        ways["capacity, none dropped"] = block.clone(routing="capacity", capacity_factor=8.0)
    for name, way in ways.items():
        y, sown = jax.jit(lambda v, x, way=way: way.apply(v, x, mutable=["moe"]))(variables, x)
        np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5, err_msg=name)
        assert float(moe_statistics(sown)["dropped_fraction"]) == pytest.approx(0.0, abs=1e-6), name


def test_the_correction_bias_chooses_experts_but_never_weighs_them():
    logits = jnp.asarray(tokens(11, (6, 8)))
    bias = jnp.asarray(tokens(12, (8,)))
    options = {"scoring": "sigmoid", "groups": 4, "groups_per_token": 2, "normalize_top_k": False}
    chosen, gates, scores = route(logits, 3, correction_e=bias, **options)
    plain, _, _ = route(logits, 3, **options)
    assert not np.array_equal(np.sort(chosen, -1), np.sort(plain, -1))  # the bias changed choices
    np.testing.assert_array_equal(gates, jnp.take_along_axis(jax.nn.sigmoid(logits), chosen, -1))
    # Only experts of a token's two best groups (by their two best corrected scores) are chosen.
    corrected = (np.asarray(jax.nn.sigmoid(logits)) + np.asarray(bias)[None]).reshape(6, 4, 2)
    best = np.argsort(-corrected.sum(-1), axis=-1)[:, :2]
    assert all(set(np.asarray(chosen[n]) // 2) <= set(best[n]) for n in range(6))


def drawn(block: RoutedExperts, x: jax.Array, seed: int) -> dict:
    """block's parameters drawn at random (shapes from an abstract init: nothing compiles)."""
    shapes = nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(0), x))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5, jnp.float32), shapes)


def by_hand(params: dict, x: jax.Array, chosen: np.ndarray, gates: jax.Array) -> jax.Array:
    """Each token through each of its chosen experts: choice k of every token takes that
    token's expert's own weights (gathered per token), gated and summed. No sorting, no groups."""
    x_nd = x.reshape(-1, x.shape[-1])
    chosen_nk, gates_nk = chosen.reshape(x_nd.shape[0], -1), gates.reshape(x_nd.shape[0], -1)
    total = jnp.zeros_like(x_nd)
    for k in range(chosen_nk.shape[1]):
        mine = {name: params[name][chosen_nk[:, k]] for name in ("wi", "wi_gate", "wo")}
        hidden = (jax.nn.silu(jnp.einsum("nd,ndm->nm", x_nd, mine["wi_gate"]))
                  * jnp.einsum("nd,ndm->nm", x_nd, mine["wi"]))
        total = total + gates_nk[:, k, None] * jnp.einsum("nm,nmd->nd", hidden, mine["wo"])
    return total.reshape(x.shape)


@pytest.mark.slow
def test_dropless_serves_every_token_even_when_all_choose_one_expert():
    block = RoutedExperts(experts=4, hidden_features=HIDDEN, experts_per_token=2)
    x = jnp.asarray(np.abs(tokens(13, (2, 6, FEATURES))))
    params = drawn(block, x, 13)
    # A router that sends every token to expert 2 first (and some other second).
    params["router"] = params["router"].at[:, 2].add(5.0) * 3
    chosen, _, _ = route(x @ params["router"], 2)
    assert bool(jnp.all(chosen[..., 0] == 2))

    def loop_loss(params, x):
        # The gates are recomputed from the parameters, so their gradient is the loop's too.
        _, gates, _ = route(x @ params["router"], 2)
        y = by_hand(params, x, np.asarray(chosen), gates)
        return jnp.sum(jnp.sin(y)), y

    (_, expected), expected_grads = jax.jit(jax.value_and_grad(loop_loss, argnums=(0, 1), has_aux=True))(
        params, x)
    for grouped_matmul in ("ragged_dot", "tiles"):
        way = block.clone(grouped_matmul=grouped_matmul)

        def block_loss(params, x, way=way):
            y, _ = way.apply({"params": params}, x, mutable=["moe"])
            return jnp.sum(jnp.sin(y)), y

        (_, y), grads = jax.jit(jax.value_and_grad(block_loss, argnums=(0, 1), has_aux=True))(params, x)
        np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=grouped_matmul)
        assert float(jnp.abs(grads[0]["wi"][2]).sum()) > 0  # the gradient reached the crowded expert
    # The capacity form of the same block drops much of expert 2's load.
    _, sown = jax.jit(lambda v, x: block.clone(routing="capacity").apply(v, x, mutable=["moe"]))(
        {"params": params}, x)
    assert float(moe_statistics(sown)["dropped_fraction"]) > 0.2


def test_the_tiles_hold_every_row_of_the_most_lopsided_groups():
    x = jnp.asarray(tokens(14, (11, 3)))
    w = jnp.asarray(tokens(15, (4, 3, 2)))
    def grouped(sizes, tile):
        groups = SortedGroups.of(sizes, 11, "tiles", tile)
        return groups.unpack(groups.matmul(groups.pack(x), w))

    compiled = {tile: jax.jit(lambda sizes, tile=tile: grouped(sizes, tile)) for tile in (1, 4, 16)}
    for sizes in ([11, 0, 0, 0], [0, 0, 0, 11], [1, 1, 1, 8], [3, 0, 5, 3]):
        xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
        expected = np.concatenate([xs[a:b] @ ws[g] for g, (a, b) in
                                   enumerate(zip(np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True))])
        for tile, run in compiled.items():
            got = run(jnp.asarray(sizes, jnp.int32))
            np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=f"{sizes} {tile}")


@pytest.mark.parametrize("padded", [False, True])
def test_statistics_are_the_balance_and_z_loss_formulas(padded):
    """Over the tokens present: padding (present false) moves neither statistic."""
    block = RoutedExperts(experts=4, hidden_features=HIDDEN, experts_per_token=2, scoring="sigmoid")
    x = jnp.asarray(tokens(16, (2, 5, FEATURES)))
    present = np.ones((2, 5), bool)
    if padded:
        present[0, 3:] = present[1, 4:] = False
    params = drawn(block, x, 16)
    _, sown = jax.jit(lambda v, x, p: block.apply(v, x, p, mutable=["moe"]))(
        {"params": params}, x, jnp.asarray(present))
    stats = moe_statistics(sown)
    kept = np.asarray(x, np.float64)[present]
    logits = kept @ np.asarray(params["router"], np.float64)
    scores = 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-scores, axis=-1)[:, :2]
    share = np.bincount(chosen.ravel(), minlength=4) / chosen.size
    probabilities = (scores / scores.sum(-1, keepdims=True)).mean(0)
    assert float(stats["load_balancing_loss"]) == pytest.approx(4 * np.sum(share * probabilities), rel=1e-5)
    z = np.log(np.exp(logits).sum(-1)) ** 2
    assert float(stats["router_z_loss"]) == pytest.approx(z.mean(), rel=1e-5)


@pytest.mark.parametrize("options, words", [
    ({"experts_per_token": 5}, "experts_per_token=5"),
    ({"groups": 3}, "must divide experts=4"),
    ({"groups": 4, "groups_per_token": 1}, "two best experts"),
    ({"groups": 2, "groups_per_token": 1, "experts_per_token": 3}, "raise groups_per_token"),
    ({"scoring": "relu"}, "scoring 'relu'"),
    ({"routing": "dropped"}, "routing 'dropped'"),
])
def test_impossible_settings_are_refused_by_name(options, words):
    block = RoutedExperts(**{"experts": 4, "hidden_features": 4, **options})
    with pytest.raises(ExpertConfigError, match=words):
        block.init(jax.random.key(0), jnp.ones((1, 2, 3)))
