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
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dew.errors import DewError

__all__ = ["ACCELERATORS", "PEAK_BF16_FLOPS", "Accelerator", "UnknownAcceleratorError", "accelerator", "peak_flops"]

# Each name is matched as whole words of the device kind JAX reports, the first that matches
# winning: a variant (an H100 on PCIe, an L40S, a TPU v5 lite) before its family.
PEAK_BF16_FLOPS: dict[str, float] = {
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "gh200": 989e12,
    "h200": 989e12,
    "h100": 989e12,
    "h800": 989e12,
    "b200": 2250e12,
    "a100": 312e12,
    "a800": 312e12,
    "l40s": 362e12,
    "l40": 181e12,
    "l4": 121e12,
    "a10": 125e12,
    "tpu v4 lite": 138e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,  # v5p, as JAX names it on some hosts
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def peak_flops(device_kind: str, environ: Mapping[str, str] | None = None) -> float | None:
    """The peak FLOP/s of one device of this kind (DEW_PEAK_FLOPS first), or None if unknown.

    >>> [peak_flops(kind, environ={}) / 1e12 for kind in ("NVIDIA L40S", "NVIDIA L4", "NVIDIA H100 PCIe", "TPU v5")]
    [362.0, 121.0, 756.0, 459.0]
    """
    environ = os.environ if environ is None else environ
    if environ.get("DEW_PEAK_FLOPS"):
        return float(environ["DEW_PEAK_FLOPS"])
    kind = device_kind.lower()
    for name, flops in PEAK_BF16_FLOPS.items():
        if re.search(rf"(?<![a-z0-9]){re.escape(name)}(?![a-z0-9])", kind):
            return flops
    return None


@dataclass(frozen=True)
class Accelerator:
    """A device kind a plan is made for: its peak dense bf16 FLOP/s, its memory as the device reports
    it (bytes), and whether JAX pre-allocates a fraction of it (a GPU's, XLA_PYTHON_CLIENT_MEM_FRACTION)."""

    name: str
    peak_flops: float
    memory: int
    gpu: bool = False

    def usable(self, environ: Mapping[str, str] | None = None) -> int:
        """The bytes a JAX process may use: on a GPU the fraction JAX's allocator takes (0.75 unless
        XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise), on a TPU the whole memory."""
        environ = os.environ if environ is None else environ
        if not self.gpu:
            return self.memory
        try:
            fraction = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        except ValueError:
            fraction = 0.75
        return int(self.memory * min(max(fraction, 0.0), 1.0))


_MIB = 2**20
_GIB = 2**30
# The kinds ``dew plan --device-kind`` knows, by the short names it takes; a GPU's memory as its
# driver reports it (nvidia-smi's MiB), which is less than the marketed decimal gigabytes.
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("NVIDIA H100 SXM (80 GB)", PEAK_BF16_FLOPS["h100"], 81559 * _MIB, gpu=True),
    "h200": Accelerator("NVIDIA H200 SXM (141 GB)", PEAK_BF16_FLOPS["h200"], 143771 * _MIB, gpu=True),
    "a100": Accelerator("NVIDIA A100 SXM (80 GB)", PEAK_BF16_FLOPS["a100"], 81920 * _MIB, gpu=True),
    "l4": Accelerator("NVIDIA L4 (24 GB)", PEAK_BF16_FLOPS["l4"], 23034 * _MIB, gpu=True),
    "tpu-v4": Accelerator("TPU v4 (32 GiB)", PEAK_BF16_FLOPS["tpu v4"], 32 * _GIB),
    "tpu-v5e": Accelerator("TPU v5e (16 GiB)", PEAK_BF16_FLOPS["tpu v5e"], 16 * _GIB),
    "tpu-v5p": Accelerator("TPU v5p (95 GiB)", PEAK_BF16_FLOPS["tpu v5p"], 95 * _GIB),
    "tpu-v6e": Accelerator("TPU v6e (32 GiB)", PEAK_BF16_FLOPS["tpu v6 lite"], 32 * _GIB),
}


class UnknownAcceleratorError(DewError, ValueError):
    """A device kind that is not in the table of ACCELERATORS."""


def accelerator(kind: str) -> Accelerator:
    """The table's entry for kind (case and spaces ignored); UnknownAcceleratorError names the known ones.

    >>> accelerator("H100").memory, accelerator("H100").usable(environ={})
    (85520809984, 64140607488)
    """
    key = kind.strip().lower().replace(" ", "-").replace("_", "-")
    if key not in ACCELERATORS:
        raise UnknownAcceleratorError(
            f"No device kind {kind!r} in dew's table of accelerators; the known kinds are "
            f"{', '.join(ACCELERATORS)}."
        )
    return ACCELERATORS[key]
