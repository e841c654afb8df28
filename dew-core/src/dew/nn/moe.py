"""A mixture-of-experts feed-forward block: top-k routing with a fixed capacity per expert.

Each token is sent to the experts_per_token experts its router scores
highest, and the block's output is those experts' outputs weighted by the
router's probabilities. An expert processes at most ``capacity`` tokens of a
sequence; the rest of its assignments are dropped (the token then skips that
expert, and the residual connection around the block carries it), as in
Switch Transformer and GShard. First choices are served before second
choices, so a token loses its second expert before another loses its first.

Capacity is counted per sequence (a row of the batch), which makes routing a
function of the row alone: the same tokens are kept and dropped however the
batch is split over devices, so a sharded run computes what one device does.

The expert weights are stacked as [experts, ...] with the leading dimension
named ``EXPERT``, which DEFAULT_RULES places on the 'expert' mesh axis; the
tokens dispatched to the experts are constrained to ``ACTIVATION_EXPERT`` on
the same axis, so the compiler moves tokens to their experts' devices (the
all-to-all of expert parallelism) instead of gathering the weights.

The block sows three scalars into the ``"moe"`` collection: the
load-balancing loss (Switch's E * sum_e f_e * P_e, which is 1 when routing is
uniform and grows as it concentrates), ST-MoE's router z-loss (the mean
squared logsumexp of the router's logits) and the fraction of assignments
dropped for lack of capacity. Apply with ``mutable=["moe"]`` to read them;
:func:`moe_statistics` averages them over layers.

The routing and the experts' weights are shared with ``dew.nn.experts``
(the dropless block of the published MoE families), whose
``routing="capacity"`` runs through :func:`capacity_experts` here.

>>> import jax, jax.numpy as jnp
>>> block = MoEBlock(experts=4, hidden_features=16, experts_per_token=2)
>>> x = jnp.ones((2, 6, 8))
>>> variables = block.init(jax.random.key(0), x)
>>> y, sown = block.apply(variables, x, mutable=["moe"])
>>> y.shape, variables["params"]["wi"].value.shape
((2, 6, 8), (4, 8, 16))
>>> sorted(moe_statistics(sown))
['dropped_fraction', 'load_balancing_loss', 'router_z_loss']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.errors import DewError
from dew.nn import sharding as axes
from dew.nn.sharding import constrain, param

__all__ = [
    "MOE_COLLECTION",
    "ROUTING_STATISTICS",
    "ExpertConfigError",
    "MoEBlock",
    "balance_loss",
    "capacity_experts",
    "einsum_experts",
    "expert_capacity",
    "expert_kernels",
    "moe_statistics",
    "router_z_loss",
]

MOE_COLLECTION = "moe"
"""The collection an MoE block sows its routing statistics into."""

ROUTING_STATISTICS = ("load_balancing_loss", "router_z_loss", "dropped_fraction")
"""The scalars an MoE block sows into MOE_COLLECTION, one of each per call."""

Dtype = Any


class ExpertConfigError(DewError, ValueError):
    """An MoE block's experts, experts per token or capacity factor cannot work together."""


def expert_capacity(length: int, experts: int, experts_per_token: int, factor: float) -> int:
    """Tokens one expert may take from a sequence of length tokens.

    The even share of a sequence's assignments (length * experts_per_token /
    experts) times factor, rounded up, and never more than length: an expert
    is chosen by a token at most once.

    >>> expert_capacity(8, experts=4, experts_per_token=2, factor=1.0)
    4
    >>> expert_capacity(8, experts=4, experts_per_token=2, factor=10.0)
    8
    """
    return max(1, min(length, math.ceil(factor * length * experts_per_token / experts)))


class MoEBlock(nn.Module):
    """A feed-forward block of experts GELU or SwiGLU blocks behind a top-k router.

    experts_per_token experts serve each token; capacity_factor scales each
    expert's capacity (expert_capacity) above the even share of a sequence's
    tokens. Outputs are weighted by the router's probabilities of the chosen
    experts, renormalized to sum to one when more than one is chosen.
    """

    experts: int
    hidden_features: int
    experts_per_token: int = 2
    capacity_factor: float = 1.25
    activation: Literal["gelu", "swiglu"] = "gelu"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _check(self) -> None:
        if self.experts < 1 or not 1 <= self.experts_per_token <= self.experts:
            raise ExpertConfigError(
                f"An MoE block needs at least one expert and 1 <= experts_per_token <= experts, "
                f"got experts={self.experts} and experts_per_token={self.experts_per_token}; "
                "choose experts_per_token between 1 and the number of experts."
            )
        if not self.capacity_factor > 0:
            raise ExpertConfigError(
                f"MoEBlock.capacity_factor must be positive, got {self.capacity_factor}; 1.0 gives "
                "each expert its even share of a sequence's tokens, 1.25 leaves a quarter spare."
            )
        if self.activation not in ("gelu", "swiglu"):
            raise ExpertConfigError(f"Unknown MLP activation {self.activation!r}; use 'gelu' or 'swiglu'.")

    @nn.compact
    def __call__(self, x: jax.Array, present: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] through the experts; present [B, T] (true for a real token) keeps
        padding out of the routing statistics."""
        self._check()
        batch, length, features = x.shape
        experts, chosen_per_token = self.experts, self.experts_per_token
        capacity = expert_capacity(length, experts, chosen_per_token, self.capacity_factor)

        router_de = param(self, "router", nn.initializers.normal(0.02), (features, experts),
                       (axes.EMBED, None), self.param_dtype)
        logits_bte = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router_de.astype(jnp.float32))
        probabilities_bte = jax.nn.softmax(logits_bte, axis=-1)  # [B, T, E]
        gates_btn, chosen_btn = jax.lax.top_k(probabilities_bte, chosen_per_token)  # [B, T, K]
        if chosen_per_token > 1:
            gates_btn = gates_btn / jnp.sum(gates_btn, axis=-1, keepdims=True)

        kernels = expert_kernels(self, experts, features, self.hidden_features, self.activation,
                                 self.param_dtype, self.dtype)
        y_btd, kept = capacity_experts(x, gates_btn, chosen_btn, experts, capacity,
                                       lambda routed: einsum_experts(routed, kernels), self.dtype)

        if self.is_initializing():  # statistics of the init's dummy input are not worth keeping
            return y_btd.astype(x.dtype)
        self.sow(MOE_COLLECTION, "load_balancing_loss",
                 balance_loss(probabilities_bte, chosen_btn, experts, present))
        self.sow(MOE_COLLECTION, "router_z_loss", router_z_loss(logits_bte, present))
        self.sow(MOE_COLLECTION, "dropped_fraction", 1.0 - kept)
        return y_btd.astype(x.dtype)


def expert_kernels(module: nn.Module, experts: int, features: int, hidden_features: int,
                   activation: str, param_dtype: Dtype, dtype: Dtype) -> dict[str, jax.Array]:
    """The stacked weights of module's experts, each [experts, ...] with the EXPERT axis first.

    ``wi`` (and ``wi_gate`` for SwiGLU) [E, features, hidden] and ``wo`` [E, hidden,
    features], declared on module in that order and cast to dtype.
    """
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))

    def kernel(name: str, shape: tuple[int, int], names: tuple[str, str]) -> jax.Array:
        return param(module, name, init, (experts, *shape), (axes.EXPERT, *names), param_dtype).astype(dtype)

    up = (features, hidden_features)
    kernels = {"wi": kernel("wi", up, (axes.EMBED, axes.MLP))}
    if activation == "swiglu":
        kernels["wi_gate"] = kernel("wi_gate", up, (axes.EMBED, axes.MLP))
    kernels["wo"] = kernel("wo", (hidden_features, features), (axes.MLP, axes.EMBED))
    return kernels


def einsum_experts(routed_ebsd: jax.Array, kernels: Mapping[str, jax.Array]) -> jax.Array:
    """Every expert's feed-forward block on the tokens dispatched to it, [E, B, S, D] in and out.

    SwiGLU when kernels hold ``wi_gate``, GELU otherwise (kernels from expert_kernels).
    """
    h_ebsm = jnp.einsum("ebsd,edm->ebsm", routed_ebsd, kernels["wi"])
    if "wi_gate" in kernels:
        gate_ebsm = jnp.einsum("ebsd,edm->ebsm", routed_ebsd, kernels["wi_gate"])
        h_ebsm = nn.silu(gate_ebsm) * h_ebsm
    else:
        h_ebsm = nn.gelu(h_ebsm)
    h_ebsm = constrain(h_ebsm, (axes.ACTIVATION_EXPERT, axes.BATCH, None, axes.ACTIVATION_MLP))
    return jnp.einsum("ebsm,emd->ebsd", h_ebsm, kernels["wo"])


def capacity_experts(x_btd: jax.Array, gates_btn: jax.Array, chosen_btn: jax.Array, experts: int,
                     capacity: int, ffn: Callable[[jax.Array], jax.Array],
                     dtype: Dtype) -> tuple[jax.Array, jax.Array]:
    """Route each token to its chosen experts, at most capacity tokens of a row per expert.

    gates_btn and chosen_btn [B, T, K] are each token's K gate values and expert ids,
    first choice first; ffn maps the dispatched tokens [E, B, capacity, D] to the experts'
    outputs of the same shape. Returns the gated sum of each token's kept experts' outputs
    [B, T, D] and the fraction of the B * T * K assignments kept.
    """
    batch, length, _ = x_btd.shape
    chosen_per_token = chosen_btn.shape[-1]
    # n: the experts_per_token choices of a token; s: an expert's capacity slots, the positions
    # of the tokens it takes from a row.
    choice_btne = jax.nn.one_hot(chosen_btn, experts, dtype=jnp.int32)  # [B, T, K, E]
    # Slots are handed out first choice first, then second choice, each in token order.
    ordered_bne = jnp.swapaxes(choice_btne, 1, 2).reshape(batch, chosen_per_token * length, experts)
    slot_bne = jnp.cumsum(ordered_bne, axis=1) * ordered_bne - 1  # -1 where the expert was not chosen
    slot_btne = jnp.swapaxes(slot_bne.reshape(batch, chosen_per_token, length, experts), 1, 2)
    # one_hot of -1 (not chosen) or of capacity and above (dropped) is all zeros.
    placed_btnes = jax.nn.one_hot(slot_btne, capacity, dtype=jnp.float32)  # [B, T, K, E, C]
    dispatch_btes = jnp.sum(placed_btnes, axis=2)  # [B, T, E, C]
    combine_btes = jnp.sum(placed_btnes * gates_btn[..., None, None], axis=2)

    # Each device routes its own rows to every expert, then one reshard (an all-to-all
    # over the expert axis) trades its rows' share of all experts for all rows' share
    # of its own experts; the outputs travel back the same way.
    local_axes = (None, axes.BATCH, None, axes.ACTIVATION_EMBED)
    expert_axes = (axes.ACTIVATION_EXPERT, axes.BATCH, None, axes.ACTIVATION_EMBED)
    routed_ebsd = constrain(jnp.einsum("btes,btd->ebsd", dispatch_btes.astype(dtype), x_btd), local_axes)
    routed_ebsd = constrain(routed_ebsd, expert_axes)
    out_ebsd = constrain(ffn(routed_ebsd), expert_axes)
    out_ebsd = constrain(out_ebsd, local_axes)
    # "a" is the slots here, so einsum sums them before the experts, as it always has
    y_btd = jnp.einsum("btea,ebad->btd", combine_btes.astype(dtype), out_ebsd)
    kept = jnp.sum(dispatch_btes) / (batch * length * chosen_per_token)
    return y_btd, kept


def balance_loss(probabilities_bte: jax.Array, chosen_btn: jax.Array, experts: int,
                 present_bt: jax.Array | None = None) -> jax.Array:
    """Switch Transformer's load-balancing loss: experts * sum_e f_e * P_e.

    f_e is expert e's share of the assignments chosen_btn [..., K] and P_e its mean
    probability [..., E] over the tokens; 1 when routing is uniform, larger as it concentrates.
    present_bt [...] (true for a real token) leaves padding out of both, as transformers'
    attention mask does.
    """
    chosen_per_token = chosen_btn.shape[-1]
    weight_bt = _token_weights(chosen_btn.shape[:-1], present_bt)
    tokens = jnp.maximum(jnp.sum(weight_bt), 1.0)
    counts_te = jnp.sum(jax.nn.one_hot(chosen_btn, experts, dtype=jnp.float32), axis=-2)
    share_e = jnp.einsum("...e,...->e", counts_te, weight_bt) / (tokens * chosen_per_token)
    mean_e = jnp.einsum("...e,...->e", probabilities_bte.astype(jnp.float32), weight_bt) / tokens
    return experts * jnp.sum(share_e * mean_e)


def router_z_loss(logits_bte: jax.Array, present_bt: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(router logits) squared.

    It keeps the router's logits small, where its softmax (and the bf16 matmuls
    before it) stay well conditioned. present_bt leaves padding out of the mean.
    """
    squared_bt = jnp.square(jax.nn.logsumexp(logits_bte.astype(jnp.float32), axis=-1))
    weight_bt = _token_weights(squared_bt.shape, present_bt)
    return jnp.sum(squared_bt * weight_bt) / jnp.maximum(jnp.sum(weight_bt), 1.0)


def _token_weights(shape: tuple[int, ...], present: jax.Array | None) -> jax.Array:
    """1.0 for each token a routing statistic counts: all of them, or those present marks."""
    if present is None:
        return jnp.ones(shape, jnp.float32)
    return jnp.broadcast_to(present, shape).astype(jnp.float32)


def moe_statistics(sown: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Each statistic of ROUTING_STATISTICS in an apply's sown "moe" collection, averaged
    over the MoE blocks that sowed it (empty when none did).

    sown is the mutable output of ``apply(..., mutable=["moe"])``, with or
    without its "moe" key. A scanned stack sows one value per layer (an array
    with a leading layers axis): each counts as one block.
    """
    tree = sown.get(MOE_COLLECTION, sown) if isinstance(sown, Mapping) else sown
    found: dict[str, list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [k.key if isinstance(k, jax.tree_util.DictKey) else None for k in path]
        name = next((n for n in reversed(names) if n in ROUTING_STATISTICS), None)
        if name is not None:
            found.setdefault(name, []).append(jnp.ravel(jnp.asarray(leaf, jnp.float32)))
    return {name: jnp.mean(jnp.concatenate(values)) for name, values in found.items()}
