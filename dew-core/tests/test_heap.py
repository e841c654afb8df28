"""A fit holds the heap it found out of the garbage collector's full passes, and gives it back.

Run in a fresh interpreter: the suite's own processes freeze their heap after collection
(conftest.py), and a fit leaves a heap its process froze alone.
"""

from __future__ import annotations

import json

CHILD = r'''
import gc, json
import jax, optax
from dew import Trainer
from dew.testing import doubles

class Counting(doubles.RecordingTracker):
    """Records, at each logged step, how many objects the collector holds frozen."""
    def __init__(self):
        super().__init__()
        self.frozen = []
    def log(self, values, step):
        self.frozen.append(gc.get_freeze_count())
        super().log(values, step)

def fit(tracker, steps=3):
    trainer = Trainer(doubles.Regression(), optax.adam(1e-2), key=jax.random.key(0), tracker=tracker)
    return trainer.fit(doubles.regression_dataset(), steps=steps, log_every=1)

# A cycle alive when the fit starts: frozen during the fit, collectable again after it.
cycle = [None]
cycle[0] = cycle
watched = id(cycle)
before = gc.get_freeze_count()
own = Counting()
fit(own)
after = gc.get_freeze_count()

del cycle
gc.collect()
alive_after = any(id(o) == watched for o in gc.get_objects())

gc.freeze()  # the process manages its heap itself: a fit leaves it as it is
held = gc.get_freeze_count()
managed = Counting()
fit(managed)
print(json.dumps({"before": before, "during": own.frozen, "after": after, "alive_after": alive_after,
                  "held": held, "managed": managed.frozen, "held_after": gc.get_freeze_count()}))
'''


def test_a_fit_freezes_the_heap_it_found_and_unfreezes_it_after(python_in_subprocess):
    seen = json.loads(python_in_subprocess(CHILD).strip().splitlines()[-1])
    assert seen["before"] == 0 and seen["after"] == 0, seen
    # every logged step ran with the objects alive at the fit's start frozen (JAX's among them)
    assert len(seen["during"]) == 3 and min(seen["during"]) > 10_000, seen
    assert not seen["alive_after"]  # after the fit, a cycle it found is collected as before
    # a process that froze its own heap keeps exactly what it froze, during and after the fit
    assert seen["held"] > 0 and set(seen["managed"]) == {seen["held"]} and seen["held_after"] == seen["held"], seen
