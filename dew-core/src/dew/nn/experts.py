"""The routed mixture-of-experts MLP of the published MoE families (Mixtral, Qwen-MoE, DeepSeek-V3).

A router scores every expert for every token; each token goes to the
experts_per_token experts it scores highest, and the block returns the sum of
their SwiGLU outputs weighted by the router's gates, plus any shared experts'
outputs. The options are the ones those families differ in:

- ``scoring``: the scores are the softmax of the router's logits (Mixtral,
  Qwen) or their sigmoids (DeepSeek-V3).
- ``normalize_top_k``: the chosen experts' scores are rescaled to sum to one
  (Mixtral always, Qwen's ``norm_topk_prob``, DeepSeek-V3's); then every gate is
  multiplied by ``routed_scale`` (DeepSeek's ``routed_scaling_factor``).
- ``score_correction``: a per-expert bias (``e_score_correction_bias``) added to
  the scores to choose the experts, never to weigh them. No gradient reaches
  it: DeepSeek-V3 moves it by its own balancing rule, not by the loss.
- ``groups`` / ``groups_per_token``: group-limited routing (DeepSeek-V3's
  ``n_group`` / ``topk_group``): the experts are split into groups, each
  group scored by the sum of its two best (corrected) scores, and a token
  chooses only among the experts of its best groups_per_token groups.
- ``shared_features``: shared experts every token passes through, one SwiGLU
  block of that hidden width (DeepSeek's ``moe_intermediate_size *
  n_shared_experts``), under ``shared``; with ``shared_gate`` its output is
  scaled by sigmoid(x . w) first (Qwen2-MoE's ``shared_expert_gate``).

``routing="dropless"`` (the default) never drops a token: the B * T * K
token-expert assignments are sorted by expert, each expert multiplies its run
of rows (``dew.nn.grouped``: ``jax.lax.ragged_dot`` on accelerators), and the
outputs are put back in token order. ``routing="capacity"`` is the
capacity-factor einsum of ``dew.nn.moe`` (each expert takes at most
capacity_factor times its even share of a row's tokens; the rest are dropped).

The experts' weights are stacked [experts, ...] under the names MoEBlock uses
(``wi``, ``wi_gate``, ``wo``) with the EXPERT axis first, so ``Layout`` splits
them over the 'expert' mesh axis; the router is ``router`` [features,
experts]. The block sows ``dew.nn.moe.ROUTING_STATISTICS`` (balance loss,
router z-loss, dropped fraction: zero when dropless) into the "moe"
collection, which ``LMObjective`` adds to its loss.

>>> import jax, jax.numpy as jnp
>>> from dew.nn.moe import moe_statistics
>>> block = RoutedExperts(experts=4, hidden_features=8, experts_per_token=2)
>>> x = jnp.ones((2, 3, 6))
>>> variables = block.init(jax.random.key(0), x)
>>> y, sown = block.apply(variables, x, mutable=["moe"])
>>> y.shape, float(moe_statistics(sown)["dropped_fraction"])
((2, 3, 6), 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.grouped import GROUPED_MATMULS, SortedGroups
from dew.nn.moe import (
    MOE_COLLECTION,
    ExpertConfigError,
    balance_loss,
    capacity_experts,
    einsum_experts,
    expert_capacity,
    expert_kernels,
    router_z_loss,
)
from dew.nn.sharding import constrain, param

__all__ = ["EXPERT_WEIGHTS", "ROUTING_WEIGHTS", "ROUTINGS", "SCORINGS", "RoutedExperts", "Routing", "route",
           "too_narrow_to_adapt"]

Dtype = Any

ROUTINGS = ("dropless", "capacity")
SCORINGS = ("softmax", "sigmoid")
EXPERT_WEIGHTS = ("wi", "wi_gate", "wo")
"""The stacked [experts, in, out] weights of a RoutedExperts block (LoRA adapts each expert's own)."""
ROUTING_WEIGHTS = ("router", "shared_gate")
"""The weights of an experts block that choose and weigh its experts, which LoRA adapts only where
its rank fits them: a router is as wide as its expert count, and the shared gate one column."""


def too_narrow_to_adapt(name: str, shape: tuple[int, ...], rank: int) -> bool:
    """Whether LoRA of rank leaves an experts block's weight name of shape as trained: a router or
    shared gate narrower than the rank."""
    return name in ROUTING_WEIGHTS and rank > min(shape)


@dataclass(frozen=True)
class Routing:
    """A decoder's routed experts (CausalTransformer.routing): RoutedExperts' options but the
    expert count, experts per token and capacity factor, which the decoder holds itself.

    hidden_features is each expert's hidden width (None: the decoder's
    mlp_features; DeepSeek's and Qwen's ``moe_intermediate_size``); dropless
    False selects capacity routing.
    """

    hidden_features: int | None = None
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True
    routed_scale: float = 1.0
    groups: int = 1
    groups_per_token: int = 1
    score_correction: bool = False
    shared_features: int = 0
    shared_gate: bool = False
    dropless: bool = True
    grouped_matmul: Literal["auto", "ragged_dot", "tiles"] = "auto"

    def block(self, experts: int, mlp_features: int, experts_per_token: int, capacity_factor: float,
              **kinds: Any) -> RoutedExperts:
        """The RoutedExperts block these options describe (kinds: name, dtype, param_dtype)."""
        return RoutedExperts(
            experts, self.hidden_features or mlp_features, experts_per_token, scoring=self.scoring,
            normalize_top_k=self.normalize_top_k, routed_scale=self.routed_scale, groups=self.groups,
            groups_per_token=self.groups_per_token, score_correction=self.score_correction,
            shared_features=self.shared_features, shared_gate=self.shared_gate,
            routing="dropless" if self.dropless else "capacity", capacity_factor=capacity_factor,
            grouped_matmul=self.grouped_matmul, **kinds)


def route(logits_nE: jax.Array, experts_per_token: int, *, scoring: str = "softmax",
          normalize_top_k: bool = True, routed_scale: float = 1.0, groups: int = 1,
          groups_per_token: int = 1,
          correction_e: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The chosen experts [..., K], their gates [..., K] and every expert's score [..., E].

    logits_nE are the router's float32 logits; the options are RoutedExperts'
    (see the module's docstring). The experts come best first.
    """
    experts = logits_nE.shape[-1]
    scores = jax.nn.softmax(logits_nE, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits_nE)
    choosing = scores if correction_e is None else (
        scores + jax.lax.broadcast_to_rank(correction_e.astype(jnp.float32), scores.ndim))
    if groups > 1:
        grouped = choosing.reshape(*choosing.shape[:-1], groups, experts // groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., groups]
        _, best_groups = jax.lax.top_k(group_scores, groups_per_token)
        kept_groups = jnp.sum(jax.nn.one_hot(best_groups, groups, dtype=bool), axis=-2)
        kept = jnp.repeat(kept_groups, experts // groups, axis=-1)
        choosing = jnp.where(kept, choosing, -jnp.inf)
    _, chosen = jax.lax.top_k(choosing, experts_per_token)
    gates = jnp.take_along_axis(scores, chosen, axis=-1)
    if normalize_top_k:
        total = jnp.sum(gates, axis=-1, keepdims=True)
        gates = gates / (total + 1e-20 if scoring == "sigmoid" else total)
    return chosen, gates * routed_scale, scores


class RoutedExperts(nn.Module):
    """A routed mixture of SwiGLU (or GELU) experts with optional shared experts.

    experts experts of hidden width hidden_features, experts_per_token of
    them per token; the routing options are the module docstring's. Maps
    x [B, T, D] to [B, T, D].
    """

    experts: int
    hidden_features: int
    experts_per_token: int = 2
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True
    routed_scale: float = 1.0
    groups: int = 1
    groups_per_token: int = 1
    score_correction: bool = False
    shared_features: int = 0
    shared_gate: bool = False
    routing: Literal["dropless", "capacity"] = "dropless"
    capacity_factor: float = 1.25
    activation: Literal["gelu", "swiglu"] = "swiglu"
    grouped_matmul: Literal["auto", "ragged_dot", "tiles"] = "auto"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _check(self) -> None:
        experts, chosen = self.experts, self.experts_per_token
        if experts < 1 or not 1 <= chosen <= experts:
            raise ExpertConfigError(
                f"RoutedExperts needs at least one expert and 1 <= experts_per_token <= experts, "
                f"got experts={experts} and experts_per_token={chosen}.")
        for name, value, allowed in (("scoring", self.scoring, SCORINGS),
                                     ("routing", self.routing, ROUTINGS),
                                     ("activation", self.activation, ("gelu", "swiglu")),
                                     ("grouped_matmul", self.grouped_matmul, GROUPED_MATMULS)):
            if value not in allowed:
                raise ExpertConfigError(f"Unknown RoutedExperts.{name} {value!r}; use one of "
                                        f"{', '.join(map(repr, allowed))}.")
        if self.groups < 1 or experts % self.groups or not 1 <= self.groups_per_token <= self.groups:
            raise ExpertConfigError(
                f"RoutedExperts.groups={self.groups} must divide experts={experts}, and "
                f"groups_per_token={self.groups_per_token} must lie between 1 and groups.")
        if self.groups > 1 and experts // self.groups < 2:
            raise ExpertConfigError(
                f"Group-limited routing scores a group by its two best experts, but groups="
                f"{self.groups} leaves {experts // self.groups} expert per group; use fewer groups.")
        reachable = self.groups_per_token * (experts // self.groups)
        if chosen > reachable:
            raise ExpertConfigError(
                f"experts_per_token={chosen} is more than the {reachable} experts of a token's "
                f"groups_per_token={self.groups_per_token} groups; raise groups_per_token.")
        if self.routing == "capacity" and not self.capacity_factor > 0:
            raise ExpertConfigError(f"RoutedExperts.capacity_factor must be positive, got "
                                    f"{self.capacity_factor}.")

    @nn.compact
    def __call__(self, x: jax.Array, present: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] through the experts; present [B, T] (true for a real token) keeps
        padding out of the routing statistics."""
        self._check()
        batch, length, features = x.shape
        experts, chosen_per_token = self.experts, self.experts_per_token
        router_de = param(self, "router", nn.initializers.normal(0.02), (features, experts),
                          (axes.EMBED, None), self.param_dtype)
        correction_e = None
        if self.score_correction:
            correction_e = jax.lax.stop_gradient(param(
                self, "score_correction", nn.initializers.zeros, (experts,), (None,), jnp.float32))
        logits_bte = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router_de.astype(jnp.float32))
        chosen_btk, gates_btk, scores_bte = route(
            logits_bte, chosen_per_token, scoring=self.scoring, normalize_top_k=self.normalize_top_k,
            routed_scale=self.routed_scale, groups=self.groups, groups_per_token=self.groups_per_token,
            correction_e=correction_e)
        kernels = expert_kernels(self, experts, features, self.hidden_features, self.activation,
                                 self.param_dtype, self.dtype)
        given_dtype, x = x.dtype, x.astype(self.dtype)
        if self.routing == "capacity":
            capacity = expert_capacity(length, experts, chosen_per_token, self.capacity_factor)
            y_btd, kept = capacity_experts(x, gates_btk, chosen_btk, experts, capacity,
                                           lambda routed: einsum_experts(routed, kernels), self.dtype)
        else:
            y_btd, kept = self._dropless(x, gates_btk, chosen_btk, kernels), jnp.float32(1.0)
        y_btd = constrain(y_btd, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED))

        if self.shared_features:
            from dew.nn.layers import MLPBlock  # layers builds this block: imported when used

            shared_btd = MLPBlock(self.shared_features, "swiglu", name="shared", dtype=self.dtype,
                                  param_dtype=self.param_dtype)(x)
            if self.shared_gate:
                gate_d1 = param(self, "shared_gate", nn.initializers.lecun_normal(), (features, 1),
                                (axes.EMBED, None), self.param_dtype)
                shared_btd = jax.nn.sigmoid(jnp.einsum("btd,dn->btn", x, gate_d1.astype(self.dtype))) * shared_btd
            y_btd = y_btd + shared_btd

        if not self.is_initializing():  # statistics of the init's dummy input are not worth keeping
            # Balance is measured on probabilities that sum to one: sigmoid scores normalized
            # per token, as DeepSeek-V3's complementary balance loss normalizes them (it averages
            # per sequence; this one, like Switch's, over the batch's tokens).
            probabilities_bte = scores_bte if self.scoring == "softmax" else (
                scores_bte / jnp.sum(scores_bte, axis=-1, keepdims=True))
            self.sow(MOE_COLLECTION, "load_balancing_loss",
                     balance_loss(probabilities_bte, chosen_btk, experts, present))
            self.sow(MOE_COLLECTION, "router_z_loss", router_z_loss(logits_bte, present))
            self.sow(MOE_COLLECTION, "dropped_fraction", 1.0 - kept)
        return y_btd.astype(given_dtype)

    def _dropless(self, x_btd: jax.Array, gates_btk: jax.Array, chosen_btk: jax.Array,
                  kernels: dict[str, jax.Array]) -> jax.Array:
        """Every assignment served: sort by expert, grouped matmuls, unsort, gate and sum."""
        batch, length, features = x_btd.shape
        tokens, chosen_per_token = batch * length, chosen_btk.shape[-1]
        rows = tokens * chosen_per_token
        x_nd = x_btd.reshape(tokens, features)
        expert_r = chosen_btk.reshape(rows)
        order_r = jnp.argsort(expert_r, stable=True)  # assignments grouped by expert, in token order
        sizes_e = jnp.bincount(expert_r, length=self.experts)
        groups = SortedGroups.of(sizes_e, rows, self.grouped_matmul)

        def spread(packed: jax.Array, width: str) -> jax.Array:
            # Tiles are laid out expert by expert and split over the expert axis, so each
            # device runs its share of the experts' work (ragged_dot's rows are left to XLA).
            if groups.kind == "ragged_dot":
                return packed
            return constrain(packed, (axes.ACTIVATION_EXPERT, None, width))

        packed = spread(groups.pack(jnp.take(x_nd, order_r // chosen_per_token, axis=0)),
                        axes.ACTIVATION_EMBED)
        h = groups.matmul(packed, kernels["wi"])
        if "wi_gate" in kernels:
            h = nn.silu(groups.matmul(packed, kernels["wi_gate"])) * h
        else:
            h = nn.gelu(h)
        h = spread(h, axes.ACTIVATION_MLP)
        out_rd = groups.unpack(groups.matmul(h, kernels["wo"]))
        # Back to token order: assignment i of the sorted rows is order_r[i].
        out_nkd = jnp.zeros_like(out_rd).at[order_r].set(out_rd, unique_indices=True)
        out_nkd = out_nkd.reshape(tokens, chosen_per_token, features)
        y_nd = jnp.einsum("nkd,nk->nd", out_nkd, gates_btk.reshape(tokens, -1).astype(self.dtype))
        return y_nd.reshape(batch, length, features)

