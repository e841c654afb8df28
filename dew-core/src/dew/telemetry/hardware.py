"""Peak dense bf16 FLOP/s per chip, for the MFU estimate a run logs.

MFU (model FLOPs utilization) is the model's FLOPs per second over the
chip's peak. The table holds the datasheet figures of common accelerators
(dense, without sparsity); ``DEW_PEAK_FLOPS`` overrides it for any device
(a CPU has no meaningful peak, so a CPU run logs no MFU unless it is set).

>>> peak_flops("NVIDIA H100 80GB HBM3", environ={})
989000000000000.0
>>> peak_flops("cpu", environ={}) is None
True
>>> peak_flops("cpu", environ={"DEW_PEAK_FLOPS": "1e12"})
1000000000000.0
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["PEAK_BF16_FLOPS", "peak_flops"]

PEAK_BF16_FLOPS: dict[str, float] = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "a10": 125e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,
}


def peak_flops(device_kind: str, environ: Mapping[str, str] | None = None) -> float | None:
    """The peak FLOP/s of one device of this kind (DEW_PEAK_FLOPS first), or None if unknown."""
    environ = os.environ if environ is None else environ
    if environ.get("DEW_PEAK_FLOPS"):
        return float(environ["DEW_PEAK_FLOPS"])
    kind = device_kind.lower()
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in kind:
            return flops
    return None
