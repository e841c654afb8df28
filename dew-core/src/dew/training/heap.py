"""The interpreter's heap held still while a fit runs.

Python's cyclic garbage collector walks every object it tracks at each full
collection. By the time a fit starts, that is everything JAX, Flax, Orbax and
the model imported and built (a million objects or more), and tracing and
lowering the step allocate enough to set off several full collections, each
a tenth of a second or more on two cores. ``frozen_heap`` moves the objects
alive when the fit starts out of the collector's view (``gc.freeze``) and
back when it ends (``gc.unfreeze``), so collections during the fit walk only
what the fit made. Objects still die as before when their last reference
goes; only a cycle among the frozen objects waits for the fit's end.

A process that froze its heap itself (``gc.get_freeze_count()`` is not 0)
manages it: the fit leaves it as it is.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the block (unless the process froze some itself).

    >>> import gc
    >>> before = gc.get_freeze_count()
    >>> with frozen_heap():
    ...     frozen = gc.get_freeze_count()
    >>> frozen > 0, gc.get_freeze_count() == before
    (True, True)
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
