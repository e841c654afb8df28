"""Quantized training of a model's trunk matmuls, through Qwix.

``apply_quantization(model, Quantization("int8"))`` returns a module that
computes the selected layers' matmuls in int8 (weights and activations, and
optionally the backward pass) while its parameters stay the float model's:
the variables tree is unchanged, so checkpoints move between the float and
the quantized model. qwix is imported only here, when a model is wrapped
(install ``dew-core[quantization]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dew.errors import DewError

if TYPE_CHECKING:
    from flax.linen import Module

__all__ = ["Quantization", "QuantizationError", "apply_quantization"]

# The layer stack of dew's backbones (layers_0, layers_1, ..., or one scanned
# stack, layers): the embedding and the output head keep full precision.
TRUNK = r".*layers(_\d+)?(/.*)?"


class QuantizationError(DewError, ValueError):
    """A quantization spec qwix cannot apply."""


@dataclass(frozen=True)
class Quantization:
    """Which matmuls train quantized, and in which dtypes.

    ``dtype`` is the weights' dtype (``"int8"``, ``"float8_e4m3fn"``, ...);
    ``activations`` that of the matmul's other operand (the same unless set;
    ``"none"`` keeps activations in float); ``backward`` quantizes the
    gradient matmuls too when set. ``modules`` is a regular expression over
    Flax module paths (``layers_0/attention/query``) choosing which layers
    are quantized: the trunk by default.
    """

    dtype: str = "int8"
    activations: str | None = None
    backward: str | None = None
    modules: str = TRUNK

    def __post_init__(self) -> None:
        import re

        try:
            re.compile(self.modules)
        except re.error as error:
            raise QuantizationError(
                f"Quantization.modules must be a regular expression over module paths; "
                f"{self.modules!r} is not: {error}."
            ) from None

    def rule(self) -> Any:
        """The qwix rule this spec describes."""
        import qwix

        activations = self.dtype if self.activations is None else self.activations
        return qwix.QtRule(
            module_path=self.modules,
            weight_qtype=self.dtype,
            act_qtype=None if activations == "none" else activations,
            bwd_qtype=self.backward,
        )


def apply_quantization(model: Module, spec: Quantization) -> Module:
    """model, wrapped so the matmuls spec selects train in spec's dtypes.

    The wrapped module's ``init`` and ``apply`` take the same inputs and
    variables as model's.
    """
    from dew._surface import import_or_explain

    qwix = import_or_explain("qwix", "dew-core")
    wrapped = qwix.quantize_model(model, qwix.QtProvider([spec.rule()]))
    # qwix swaps jax functions while the model runs: declared (dew.training.opening.InterceptsJax), so
    # the trainer builds no state on another thread while this model's step compiles.
    wrapped.__class__ = type(type(wrapped).__name__, (type(wrapped),), {"intercepts_jax": True})
    return wrapped
