"""TrainState: everything a run must checkpoint to resume where it stopped.

The run key is the root of separate random streams, one per purpose
(``STREAMS``): initialization, the training step, the rollout, evaluation
and previews. Each is a branch split from the root, and a stream's key at
step s folds s into its branch, so two purposes never draw the same key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from dew.objectives.base import Variables
from dew.training.trees import overlay_as
from dew.tree_summary import brief_repr
from dew.typing import PyTree

__all__ = ["STREAMS", "Scaler", "TrainState", "Window", "shardings_state", "stream"]

STREAMS = ("init", "step", "rollout", "evaluation", "preview")


def stream(root: jax.Array, name: str) -> jax.Array:
    """The branch of a typed root key that one purpose draws from.

    >>> import jax
    >>> keys = [stream(jax.random.key(0), name) for name in STREAMS]
    >>> len({tuple(jax.random.key_data(k).tolist()) for k in keys})
    5
    """
    if name not in STREAMS:
        raise ValueError(f"Unknown random stream {name!r}; the streams are {', '.join(STREAMS)}.")
    return jax.random.split(root, len(STREAMS))[STREAMS.index(name)]


@flax.struct.dataclass
class Scaler:
    """A dynamic loss scale and its streak of finite steps.

    The loss is multiplied by scale before differentiation, as a mean (the
    step divides its sum by a power of two at most its count); a non-finite
    gradient halves it (down to minimum), and growth_interval finite steps in
    a row double it.
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace; its type is not declared there
        def replace(self, **changes: object) -> Scaler: ...

    scale: jax.Array
    streak: jax.Array
    growth_interval: int = flax.struct.field(pytree_node=False, default=2000)
    factor: float = flax.struct.field(pytree_node=False, default=2.0)
    minimum: float = flax.struct.field(pytree_node=False, default=1.0)

    @classmethod
    def create(cls, initial: float = 2.0**15, **config: Any) -> Scaler:
        return cls(jnp.asarray(initial, jnp.float32), jnp.asarray(0, jnp.int32), **config)

    def update(self, finite: jax.Array) -> Scaler:
        grown = self.streak + 1 >= self.growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grown, self.scale * self.factor, self.scale),
            jnp.maximum(self.scale / self.factor, self.minimum),
        )
        streak = jnp.where(finite & ~grown, self.streak + 1, 0)
        return self.replace(scale=scale.astype(jnp.float32), streak=streak.astype(jnp.int32))


@flax.struct.dataclass
class Window:
    """A half-filled gradient-accumulation window: summed gradients and loss counts."""

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace; its type is not declared there
        def replace(self, **changes: object) -> Window: ...

    grads: Variables
    count: jax.Array
    filled: jax.Array


@flax.struct.dataclass
class TrainState:
    """Hold everything a run must checkpoint to resume where it stopped.

    params holds the live Flax variables (every collection, frozen leaves
    included, each once). ema holds the EMA's own leaves only: those the
    objective's EMASpec selects and does not freeze (None without an EMA);
    ``averaged`` reads as the whole tree with them in place. step counts
    attempts, microstep accepted microbatches, updates optimizer updates;
    with the root key, step decides the next random draw. key is stored as
    raw key data so it checkpoints like any array.
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace; its type is not declared there
        def replace(self, **changes: object) -> TrainState: ...

    params: Variables
    opt_state: optax.OptState
    key: jax.Array
    step: jax.Array
    microstep: jax.Array
    updates: jax.Array
    ema: Variables | None = None
    scaler: Scaler | None = None
    window: Window | None = None

    __repr__ = brief_repr  # counters as numbers, each tree as one line

    @property
    def averaged(self) -> Variables | None:
        """The variables with the EMA leaves in place (None without an EMA)."""
        return None if self.ema is None else overlay_as(self.params, self.ema)  # in the weights' dtypes

    @property
    def rng(self) -> jax.Array:
        """The root key as a typed key."""
        return jax.random.wrap_key_data(self.key)

    def stream(self, name: str) -> jax.Array:
        """The branch of the root key that one purpose (``STREAMS``) draws from."""
        return stream(self.rng, name)

    def key_for(self, step: jax.Array | int, *data: int, purpose: str = "step") -> jax.Array:
        """The key of one step (and optional further indices) in a purpose's stream."""
        key = jax.random.fold_in(self.stream(purpose), step)
        for value in data:
            key = jax.random.fold_in(key, value)
        return key


def shardings_state(**fields: PyTree) -> TrainState:
    """A TrainState whose leaves are shardings, not arrays: where each field of a state goes."""
    return TrainState(**fields)
