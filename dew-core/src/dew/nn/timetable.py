"""The rounds of a 1F1B pipeline schedule, worked out before tracing: who runs what, and when.

Every device of the ``stage`` axis runs the same program, one round after
another. In a round each device may run one forward of one chunk of layers
(on one microbatch) and then one backward of one chunk (on another); the
timetable says which, for every round and every device, and which stash slot
keeps the input of each forward until its backward reads it back.

With ``repeats`` (virtual stages, circular pipelining) the stack is cut into
``stages * repeats`` chunks and chunk ``k`` runs on device ``k % stages``, so a
microbatch goes around the ring of devices ``repeats`` times. Microbatches
enter in groups of ``stages`` (Megatron's interleaved order): a group passes
every chunk before the next group starts its second lap, so a device's last
forward output lands on device 0 exactly when that device needs it, and no
other buffer is needed than the ring shift itself.

For microbatch ``m = g * stages + j`` and chunk ``k = r * stages + d``:

* forward at round ``g*v*S + r*S + j + d``,
* backward at round ``g*v*S + 2*v*S - 2 + j - r*S - d``,

with ``S`` stages and ``v`` repeats: the last chunk's forward and backward
share a round (the loss in between), and every backward follows the one of
the chunk after it by exactly one round. A device is idle for ``stages - 1``
of the ``v * microbatches + stages - 1`` rounds in which any device runs a
forward, and as many of the backward's: the bubble,
``(stages - 1) / (v * microbatches + stages - 1)``.

>>> table = timetable(stages=2, microbatches=4)
>>> table.rounds, table.slots, round(table.bubble, 3)  # 2 stages hold at most 3 inputs each
(6, 3, 0.2)
>>> table.forward_microbatch[:, 0].tolist(), table.backward_microbatch[:, 0].tolist()
([0, 1, 2, 3, -1, -1], [-1, -1, 0, 1, 2, 3])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Timetable", "timetable"]


@dataclass(frozen=True, eq=False)
class Timetable:
    """Per round and device (arrays ``[rounds, stages]``): the microbatch (-1: idle), the lap
    (which of the device's ``repeats`` chunks) and the stash slot of its forward and backward.

    An idle device's slot is ``slots``, a spare slot nothing reads, so the
    program writes every device's input unconditionally.
    """

    stages: int
    microbatches: int
    repeats: int
    forward_microbatch: np.ndarray
    forward_lap: np.ndarray
    forward_slot: np.ndarray
    backward_microbatch: np.ndarray
    backward_lap: np.ndarray
    backward_slot: np.ndarray
    slots: int

    @property
    def rounds(self) -> int:
        return int(self.forward_microbatch.shape[0])

    @property
    def fresh(self) -> np.ndarray:
        """Per round: device 0 starts a microbatch's first chunk (its input comes from the embedding)."""
        return (self.forward_microbatch[:, 0] >= 0) & (self.forward_lap[:, 0] == 0)

    @property
    def finished(self) -> np.ndarray:
        """Per round: the last device runs a microbatch's last chunk (the loss reads its output)."""
        return (self.forward_microbatch[:, -1] >= 0) & (self.forward_lap[:, -1] == self.repeats - 1)

    @property
    def returned(self) -> np.ndarray:
        """Per round: device 0 runs the backward of a microbatch's first chunk (its input's gradient is out)."""
        return (self.backward_microbatch[:, 0] >= 0) & (self.backward_lap[:, 0] == 0)

    @property
    def forwards(self) -> np.ndarray:
        """Per round: some device runs a forward."""
        return np.asarray((self.forward_microbatch >= 0).any(axis=1))

    @property
    def backwards(self) -> np.ndarray:
        """Per round: some device runs a backward."""
        return np.asarray((self.backward_microbatch >= 0).any(axis=1))

    @property
    def bubble(self) -> float:
        """The share of device time idle, counting a round's forward and backward halves where any
        device runs one (a half no device runs is skipped)."""
        busy = 2 * self.microbatches * self.repeats * self.stages
        spent = self.stages * (int(self.forwards.sum()) + int(self.backwards.sum()))
        return 1.0 - busy / spent


def timetable(stages: int, microbatches: int, repeats: int = 1) -> Timetable:
    """The 1F1B timetable (interleaved when repeats > 1) of microbatches over stages.

    repeats > 1 needs microbatches to be a multiple of stages (groups of
    stages microbatches enter together).
    """
    if stages < 1 or microbatches < 1 or repeats < 1:
        raise ValueError(f"A timetable needs at least one stage, microbatch and repeat; got stages={stages}, "
                         f"microbatches={microbatches}, repeats={repeats}.")
    if repeats > 1 and microbatches % stages:
        raise ValueError(f"Interleaving {repeats} chunks per device sends microbatches in groups of "
                         f"stages={stages}; microbatches={microbatches} is not a multiple of it.")
    lap = repeats * stages
    forward: dict[tuple[int, int], tuple[int, int]] = {}
    backward: dict[tuple[int, int], tuple[int, int]] = {}
    for m in range(microbatches):
        group, j = divmod(m, stages)
        for r in range(repeats):
            for d in range(stages):
                for table, when in (
                    (forward, group * lap + r * stages + j + d),
                    (backward, group * lap + 2 * lap - 2 + j - r * stages - d),
                ):
                    if (when, d) in table:  # pragma: no cover - the formulas make this impossible
                        raise AssertionError(f"two chunks on device {d} in round {when}")
                    table[when, d] = (m, r)
    rounds = 1 + max(t for t, _ in backward)
    shape = (rounds, stages)
    f_mb, f_lap, b_mb, b_lap = (np.full(shape, -1, np.int32) for _ in range(4))
    for (t, d), (m, r) in forward.items():
        f_mb[t, d], f_lap[t, d] = m, r
    for (t, d), (m, r) in backward.items():
        b_mb[t, d], b_lap[t, d] = m, r
    f_slot, b_slot, slots = _allocate(f_mb, f_lap, b_mb, b_lap)
    # Idle devices read and write the spare slot, and run lap 0 (any chunk would do).
    f_slot[f_mb < 0], b_slot[b_mb < 0] = slots, slots
    f_lap[f_mb < 0], b_lap[b_mb < 0] = 0, 0
    return Timetable(stages, microbatches, repeats, f_mb, f_lap, f_slot, b_mb, b_lap, b_slot, slots)


def _allocate(f_mb: np.ndarray, f_lap: np.ndarray, b_mb: np.ndarray,
              b_lap: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Give every forward a free stash slot on its device, freed by the matching backward.

    Within a round the forward writes before the backward reads, so a chunk
    whose backward shares its forward's round (the last one) still finds its
    input. Returns both slot tables and the most slots any device needed.
    """
    rounds, stages = f_mb.shape
    f_slot = np.zeros_like(f_mb)
    b_slot = np.zeros_like(b_mb)
    peak = 0
    for d in range(stages):
        free: list[int] = []
        used = 0
        held: dict[tuple[int, int], int] = {}
        for t in range(rounds):
            if f_mb[t, d] >= 0:
                slot = min(free) if free else used
                if slot == used:
                    used += 1
                else:
                    free.remove(slot)
                held[int(f_mb[t, d]), int(f_lap[t, d])] = slot
                f_slot[t, d] = slot
            if b_mb[t, d] >= 0:
                slot = held.pop((int(b_mb[t, d]), int(b_lap[t, d])))
                b_slot[t, d] = slot
                free.append(slot)
        peak = max(peak, used)
    return f_slot, b_slot, peak
