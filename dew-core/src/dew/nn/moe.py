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

The block sows two scalars into the ``"moe"`` collection: the load-balancing
loss (Switch's E * sum_e f_e * P_e, which is 1 when routing is uniform and
grows as it concentrates) and the fraction of assignments dropped for lack of
capacity. Apply with ``mutable=["moe"]`` to read them; :func:`moe_statistics`
averages them over layers.

>>> import jax, jax.numpy as jnp
>>> block = MoEBlock(experts=4, hidden_features=16, experts_per_token=2)
>>> x = jnp.ones((2, 6, 8))
>>> variables = block.init(jax.random.key(0), x)
>>> y, sown = block.apply(variables, x, mutable=["moe"])
>>> y.shape, variables["params"]["wi"].value.shape
((2, 6, 8), (4, 8, 16))
>>> sorted(moe_statistics(sown))
['dropped_fraction', 'load_balancing_loss']
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.errors import DewError
from dew.nn import sharding as axes
from dew.nn.sharding import constrain, param

__all__ = ["MOE_COLLECTION", "ExpertConfigError", "MoEBlock", "expert_capacity", "moe_statistics"]

MOE_COLLECTION = "moe"
"""The collection an MoE block sows its routing statistics into."""

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
    def __call__(self, x: jax.Array) -> jax.Array:
        self._check()
        batch, length, features = x.shape
        experts, chosen_per_token = self.experts, self.experts_per_token
        capacity = expert_capacity(length, experts, chosen_per_token, self.capacity_factor)

        # n: the experts_per_token choices of a token; s: an expert's capacity slots, the positions
        # of the tokens it takes from a row.
        router_de = param(self, "router", nn.initializers.normal(0.02), (features, experts),
                       (axes.EMBED, None), self.param_dtype)
        logits_bte = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router_de.astype(jnp.float32))
        probabilities_bte = jax.nn.softmax(logits_bte, axis=-1)  # [B, T, E]
        gates_btn, chosen_btn = jax.lax.top_k(probabilities_bte, chosen_per_token)  # [B, T, K]
        if chosen_per_token > 1:
            gates_btn = gates_btn / jnp.sum(gates_btn, axis=-1, keepdims=True)

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
        routed_ebsd = constrain(jnp.einsum("btes,btd->ebsd", dispatch_btes.astype(self.dtype), x), local_axes)
        routed_ebsd = constrain(routed_ebsd, expert_axes)
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))

        def kernel(name: str, shape: tuple[int, int], names: tuple[str, str]) -> jax.Array:
            return param(self, name, init, (experts, *shape), (axes.EXPERT, *names),
                         self.param_dtype).astype(self.dtype)

        up = (features, self.hidden_features)
        h_ebsm = jnp.einsum("ebsd,edm->ebsm", routed_ebsd, kernel("wi", up, (axes.EMBED, axes.MLP)))
        if self.activation == "swiglu":
            gate_ebsm = jnp.einsum("ebsd,edm->ebsm", routed_ebsd, kernel("wi_gate", up, (axes.EMBED, axes.MLP)))
            h_ebsm = nn.silu(gate_ebsm) * h_ebsm
        else:
            h_ebsm = nn.gelu(h_ebsm)
        h_ebsm = constrain(h_ebsm, (axes.ACTIVATION_EXPERT, axes.BATCH, None, axes.ACTIVATION_MLP))
        down_emd = kernel("wo", (self.hidden_features, features), (axes.MLP, axes.EMBED))
        out_ebsd = constrain(jnp.einsum("ebsm,emd->ebsd", h_ebsm, down_emd), expert_axes)
        out_ebsd = constrain(out_ebsd, local_axes)
        # "a" is the slots here, so einsum sums them before the experts, as it always has
        y_btd = jnp.einsum("btea,ebad->btd", combine_btes.astype(self.dtype), out_ebsd)

        if self.is_initializing():  # statistics of the init's dummy input are not worth keeping
            return y_btd.astype(x.dtype)
        # Switch's balance loss: experts times the dot product of each expert's share of
        # the assignments and its mean router probability.
        share_e = jnp.mean(jnp.sum(choice_btne, axis=2).astype(jnp.float32), axis=(0, 1)) / chosen_per_token
        self.sow(MOE_COLLECTION, "load_balancing_loss",
                 experts * jnp.sum(share_e * jnp.mean(probabilities_bte, axis=(0, 1))))
        self.sow(MOE_COLLECTION, "dropped_fraction",
                 1.0 - jnp.sum(dispatch_btes) / (batch * length * chosen_per_token))
        return y_btd.astype(x.dtype)


def moe_statistics(sown: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The load-balancing loss and dropped fraction of an apply's sown "moe" collection,
    each averaged over the MoE blocks that sowed it (empty when none did).

    sown is the mutable output of ``apply(..., mutable=["moe"])``, with or
    without its "moe" key.
    """
    tree = sown.get(MOE_COLLECTION, sown) if isinstance(sown, Mapping) else sown
    found: dict[str, list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [k.key if isinstance(k, jax.tree_util.DictKey) else None for k in path]
        name = next((n for n in reversed(names) if n in ("load_balancing_loss", "dropped_fraction")), None)
        if name is not None:
            found.setdefault(name, []).append(jnp.asarray(leaf, jnp.float32))
    return {name: jnp.mean(jnp.stack(values)) for name, values in found.items()}
