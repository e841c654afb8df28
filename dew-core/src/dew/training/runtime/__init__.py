"""What a training process needs around the loop: setup before JAX starts, and preemption.

Every name is imported on first use, so importing this package starts nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.training.runtime.preemption import Preempted as Preempted
    from dew.training.runtime.preemption import PreemptionNotice as PreemptionNotice
    from dew.training.runtime.preemption import PreemptionWatch as PreemptionWatch
    from dew.training.runtime.preemption import UnsavedStopError as UnsavedStopError
    from dew.training.runtime.process import (
        BackendAlreadyStartedError as BackendAlreadyStartedError,
    )
    from dew.training.runtime.process import prepare_process as prepare_process
    from dew.training.runtime.process import run_timestamp as run_timestamp

__getattr__, __dir__, __all__ = surface(__name__, __file__)
