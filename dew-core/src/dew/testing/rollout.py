"""RolloutKit: a rollout returns the same shapes at every step, so the step compiles once.

A rollout (``dew.training.Rollout``) turns this process's prefetched batch
into the batch the step trains on, on the host, with the live state and a
key. The trainer compiles one step per batch signature, so a rollout whose
shapes follow its samples (completions cut to their longest, a count of
kept groups) recompiles at every step. Subclass and supply the rollout,
the state it reads and a few input batches::

    class TestMyRollout(RolloutKit):
        def rollout(self):
            return MyRollout(...)

        def state(self):
            return Trainer(objective, optax.sgd(0.0), key=jax.random.key(0)).initial_state()

        def batches(self):
            return [{"prompt": ..., "prompt_length": ...}, ...]

A rollout with ``get_state``/``set_state`` is also checked to give the same
output again after its state is restored.
"""

from __future__ import annotations

import unittest
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from dew.data.base import Resumable

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from dew.data.base import Batch as HostBatch
    from dew.training.protocols import Rollout
    from dew.training.state import TrainState

__all__ = ["RolloutKit"]


def _signature(batch: Mapping[str, ArrayLike]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in batch.items()}


class RolloutKit:
    """Conformance tests for a rollout (see the module docstring)."""

    calls: int = 3
    seed: int = 0

    def rollout(self) -> Rollout:
        """The rollout under test, freshly built."""
        raise NotImplementedError(f"{type(self).__name__} must define rollout().")

    def state(self) -> TrainState:
        """The train state the rollout reads (its params), as the trainer would pass it."""
        raise NotImplementedError(f"{type(self).__name__} must define state().")

    def batches(self) -> Sequence[HostBatch]:
        """Different input batches of one shape, as the data stream would give them."""
        raise NotImplementedError(f"{type(self).__name__} must define batches().")

    def _outputs(self, rollout: Rollout, state: TrainState) -> list[Mapping[str, np.ndarray]]:
        batches = list(self.batches())
        assert batches, "batches() returned no batch."
        out: list[Mapping[str, np.ndarray]] = []
        for index in range(self.calls):
            key = jax.random.fold_in(jax.random.key(self.seed), index)
            result = rollout(state, batches[index % len(batches)], key)
            assert isinstance(result, Mapping), (
                f"The rollout returned a {type(result).__name__}; it must return a mapping of arrays.")
            out.append({k: np.asarray(v) for k, v in result.items()})
        return out

    def test_shapes_are_the_same_at_every_call(self) -> None:
        outputs = self._outputs(self.rollout(), self.state())
        first = _signature(outputs[0])
        for index, output in enumerate(outputs[1:], start=1):
            assert _signature(output) == first, (
                f"Call {index} returned {_signature(output)}, call 0 {first}: the step would compile "
                "again. Pad to fixed shapes (and carry a mask) instead.")

    def test_every_output_has_the_same_rows(self) -> None:
        (output,) = self._outputs(self.rollout(), self.state())[:1]
        rows = {k: v.shape[0] for k, v in output.items() if v.ndim}
        assert rows and len(set(rows.values())) == 1, (
            f"The rollout's arrays must share their first axis (the rows the step splits); got {rows}.")

    def test_restored_state_repeats_the_output(self) -> None:
        rollout, state = self.rollout(), self.state()
        if not isinstance(rollout, Resumable):
            raise unittest.SkipTest(f"{type(rollout).__name__} keeps no state (no get_state/set_state).")
        self._outputs(rollout, state)
        saved = rollout.get_state()
        first = self._outputs(rollout, state)
        rollout.set_state(saved)
        again = self._outputs(rollout, state)
        for index, (a, b) in enumerate(zip(first, again, strict=True)):
            for key in a:
                assert np.array_equal(a[key], b[key]), (
                    f"After set_state, call {index} differs under {key!r}: the state does not capture "
                    "everything the rollout's output depends on.")
