"""Asynchronous rollouts: the batches of the next steps are made on a worker thread while a step trains.

A rollout that declares ``max_lag`` L > 0 (``dew.training.protocols.Lagging``)
is run ahead by the Feed: when step s is fed, the batches of steps s+1 .. s+L
that are not under way yet are handed to one worker thread with a copy of
the parameters step s starts from, and the step trains while they are made.
So step s trains on completions sampled by the policy of step s - L (at
most; fewer steps back right after a fit opens), and the objective's
importance ratio is taken against that sampling policy's log-probabilities,
which the rollout returns with the batch (GRPO's ``old_logp``).

The worker is the only reader of the stream and the only caller of the
rollout while the run is asynchronous, so the stream's batches, a refilling
rollout's refills and the rollout's own state advance in step order exactly
as on-policy. Each made batch remembers the position (stream and rollout)
it was made from; a checkpoint after step k waits for the batches under
way, which the rollout journal has written by then, and saves the position
step k's batch was made from, so a resumed run replays the batches the
stopped one made ahead, from the policies that made them, and ends bitwise
where an uninterrupted run ends. (Without a journal, a pool's other
processes or a checkpoint in a bucket, it samples them again from the
checkpoint's policy: the lag is shorter right after the resume.)

The key of step t is the run's rollout key of t, as on-policy, so ``max_lag:
0`` and the steps of an asynchronous run whose lag is 0 draw the same.

Only a run on one device of one process makes its batches on a worker
thread. On a larger mesh the sampler's programs and the step's would be
launched from two threads, and programs with collectives over several
devices, launched concurrently, may reach the devices in different orders
and deadlock; there each batch is made in the loop, when its step asks for
it, from the same lagged copy of the parameters, the same key and the same
place in the stream (``threaded=False``), so the run trains on exactly the
batches a one-device run would, without the overlap. Overlapping there
needs the trainer to launch its step and the sampler's programs in one
order (a hook of the trainer's loop), which is not there yet.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Generic, TypeVar

import jax
import jax.numpy as jnp

from dew.errors import DewError

if TYPE_CHECKING:
    from dew.training.state import TrainState

__all__ = ["Ahead", "LagError", "parameters_copy"]

Made = TypeVar("Made")


class LagError(DewError, ValueError):
    """A rollout's max_lag is not a whole number of steps >= 0."""


def parameters_copy(state: TrainState) -> TrainState:
    """state with its parameters copied: the step donates the state's buffers, the worker reads these.

    Only ``params`` is copied; a rollout run ahead reads nothing else of the
    state (its optimizer state and counters belong to the step under way).
    """
    leaves, structure = jax.tree.flatten(state.params)
    arrays = {index: leaf for index, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)}
    copies = dict(zip(arrays, _copy_all(list(arrays.values())), strict=True))
    params = jax.tree.unflatten(structure, [copies.get(index, leaf) for index, leaf in enumerate(leaves)])
    return state.replace(params=jax.block_until_ready(params))


# One dispatch copies every array (each keeps its sharding); a copy per leaf
# was a dispatch per leaf, once a step.
_copy_all = jax.jit(lambda arrays: [jnp.copy(array) for array in arrays])


class _Deferred(Generic[Made]):
    """A batch made when it is first asked for, in the asking thread (Ahead's threaded=False)."""

    def __init__(self, make: Callable[..., Made], *arguments: object) -> None:
        self._make: Callable[[], Made] | None = lambda: make(*arguments)
        self._made: Made | None = None
        self._error: BaseException | None = None

    def result(self) -> Made:
        if self._make is not None:
            make, self._make = self._make, None
            try:
                self._made = make()
            except BaseException as error:
                self._error = error
        if self._error is not None:
            raise self._error
        return self._made  # type: ignore[return-value]

    def cancel(self) -> bool:
        self._make = None
        return True


class Ahead(Generic[Made]):
    """The batches of the next ``lag`` steps, made on one worker thread (see the module docstring).

    make(state, step, key) makes one step's batch; it runs on the worker, one
    step at a time in step order. threaded=False makes each in the thread that
    takes it (or settles), when it is asked for: the same batches, in the same
    order, from the same parameters, without a second thread.
    """

    def __init__(self, make: Callable[[TrainState, int, jax.Array], Made], lag: int, *, threaded: bool = True) -> None:
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise LagError(f"max_lag must be a whole number of steps >= 0, got {lag!r}: 0 samples each "
                           "step's batch from the policy it trains, 1 (the default) from the policy one step "
                           "behind while the step before trains.")
        self.make = make
        self.lag = lag
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dew-rollout-ahead") if threaded else None
        self._pending: dict[int, Future[Made] | _Deferred[Made]] = {}
        self._failed: BaseException | None = None  # a batch that failed: none after it is made

    def take(self, state: TrainState, step: int) -> Made:
        """Step's batch (made now if it is not under way), after handing on the steps up to step + lag."""
        copied = None
        for ahead in range(step, step + self.lag + 1):
            if ahead not in self._pending:
                copied = copied if copied is not None else parameters_copy(state)
                key = jax.block_until_ready(state.key_for(ahead, purpose="rollout"))
                self._pending[ahead] = (self._pool.submit(self._make, copied, ahead, key) if self._pool is not None
                                        else _Deferred(self._make, copied, ahead, key))
        return self._pending.pop(step).result()

    def _make(self, state: TrainState, step: int, key: jax.Array) -> Made:
        # After a failure the stream and the rollout stand wherever it left them: making a later
        # step from there would journal a batch no run trains on.
        if self._failed is not None:
            raise RuntimeError(f"Not made: the batch of an earlier step failed ({self._failed!r}).")
        try:
            return self.make(state, step, key)
        except BaseException as error:
            self._failed = error
            raise

    def settle(self) -> list[tuple[int, Made]]:
        """Wait for every batch under way (make them, unthreaded); they stay to be taken. (step, batch)
        in step order."""
        return [(step, self._pending[step].result()) for step in sorted(self._pending)]

    def close(self) -> None:
        """Stop making: batches not begun are dropped, the one being made is waited for (its error dropped)."""
        for future in self._pending.values():
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pending.clear()
