"""The Rollout protocol: how a batch is made on the host before the compiled step reads it.

It sits here, beside nothing that trains, so a rollout plugin depends on
this protocol (and on ``dew.data.base``), never on the trainer. Where
reports go is the Tracker protocol of ``dew.tracking.protocol``. Importing
this module imports no JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dew.data.base import Batch, Resumable

if TYPE_CHECKING:
    import jax

    from dew.training.state import TrainState

__all__ = ["Lagging", "Refilling", "RewardTimed", "Rollout", "Serving", "StatefulRollout", "Transcribed"]


@runtime_checkable
class Rollout(Protocol):
    """Produce a batch on the host, before the compiled step reads it.

    Called with the live state, this process's prefetched batch and a key
    from the run's rollout stream (folded with the step). It returns this
    process's share of the batch the step trains on: a mapping of arrays
    whose shapes are the same at every step, so the step compiles once.
    A rollout that also has ``get_state() -> bytes`` and
    ``set_state(bytes)`` is saved with the data position and resumed.
    """

    def __call__(self, state: TrainState, batch: Batch, key: jax.Array) -> Batch: ...


@runtime_checkable
class RewardTimed(Protocol):
    """A rollout that keeps a running total of the seconds its reward took, so the run's
    goodput counts them apart from the rest of the rollout's time."""

    reward_seconds: float


@runtime_checkable
class StatefulRollout(Rollout, Resumable, Protocol):
    """A rollout whose position (get_state/set_state) a checkpoint keeps."""


@runtime_checkable
class Serving(Protocol):
    """A rollout that trains several steps on one sample (PPO's epochs of minibatches).

    ``reads_batch()`` says whether its next call samples from the batch it is
    given; when it does not, the trainer draws nothing from the stream for
    that step (it is called with an empty batch), so the records the stream
    hands out are the ones sampled from, and the data ledger lists no
    records for the steps that serve.
    """

    def reads_batch(self) -> bool: ...


@runtime_checkable
class Refilling(Protocol):
    """A rollout that may read more of the training stream within one step.

    The trainer calls ``draw_from(more)`` once, before the first step;
    ``more()`` returns this process's next batch of the stream. A rollout that
    drops part of what it sampled (dynamic sampling drops groups whose
    rewards are all equal) refills its batch from there; the stream's saved
    position counts those batches, so a resumed run reads on after them, and
    the run's data ledger lists their records with the step that drew them.
    """

    def draw_from(self, more: Callable[[], Batch]) -> None: ...


@runtime_checkable
class Transcribed(Protocol):
    """A rollout that can say, as plain data, what it scored since it was last asked.

    ``transcript()`` returns one mapping per scoring round (a refilling rollout
    scores several per step) and forgets them: ``prompts`` and ``completions``
    (text), ``rewards`` (one number each) and ``context`` (the records' other
    keys, one value per completion). The rollout journal keeps them with the
    step, so ``dew rescore`` can score them with another reward and ``dew
    report`` can show them.
    """

    def transcript(self) -> list[dict[str, object]]: ...


@runtime_checkable
class Lagging(Protocol):
    """A rollout that may sample the batches of later steps while a step trains.

    ``max_lag`` bounds how many steps the sampling policy may be behind the
    policy that trains on its batch: 0 samples each step from its own policy
    (on-policy, the batch made when the step asks for it); L > 0 makes the
    batches of the next L steps on a worker thread while a step trains
    (``dew.training.rollout_ahead``). Such a rollout reads only the state's
    parameters (a copy), and returns the sampling policy's log-probabilities
    with its batch, so the objective's importance ratio is taken against the
    policy that sampled.
    """

    max_lag: int
