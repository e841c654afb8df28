"""Quantized training of a model's trunk matmuls, under the training surface's name for it.

The implementation lives in ``dew.adapters.quantization``, beside LoRA (both wrap a model
without changing its variables); this module is where the training reference documents
``Quantization`` and ``apply_quantization``, so ``from dew.training.quantization import
Quantization`` works as written there.
"""

from __future__ import annotations

from dew.adapters.quantization import Quantization, QuantizationError, apply_quantization

__all__ = ["Quantization", "QuantizationError", "apply_quantization"]
