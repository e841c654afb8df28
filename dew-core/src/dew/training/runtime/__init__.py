"""What a training process needs around the loop: setup before JAX starts, and preemption.

Every name resolves on first use, so importing this package starts nothing.
"""

from dew._lazy import Export, exporter

_PREEMPTION = "dew.training.runtime.preemption"
_PROCESS = "dew.training.runtime.process"
_EXPORTS = {
    "Preempted": Export(_PREEMPTION),
    "PreemptionNotice": Export(_PREEMPTION),
    "PreemptionWatch": Export(_PREEMPTION),
    "BackendAlreadyStartedError": Export(_PROCESS),
    "prepare_process": Export(_PROCESS),
    "run_timestamp": Export(_PROCESS),
}

__getattr__, __dir__ = exporter(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
