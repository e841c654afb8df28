"""What can go wrong moving weights in and out, each error named for its cause."""

from __future__ import annotations

from dew.errors import DewError

__all__ = [
    "ConfigValueError",
    "ConfigurationMismatchError",
    "DamagedFileError",
    "NoPretrainedModelError",
    "NoExactCounterpartError",
    "PretrainedError",
    "TensorMismatchError",
    "UnsupportedArchitectureError",
    "VocabularyMismatchError",
]


class PretrainedError(DewError, ValueError):
    """A pretrained directory or model that cannot be read or written as asked."""


class NoPretrainedModelError(DewError, FileNotFoundError):
    """The directory holds no model to load (no config.json): not written yet, or another folder."""


class NoExactCounterpartError(PretrainedError):
    """A model configuration that the target format cannot express exactly.

    dew never exports approximately: the field named in the message has to
    change (and the model be retrained) before the weights mean the same there.
    """


class UnsupportedArchitectureError(PretrainedError):
    """A checkpoint of an architecture dew cannot load."""


class TensorMismatchError(PretrainedError):
    """A tensor is missing, left over, or of another shape than the model needs."""


class VocabularyMismatchError(PretrainedError):
    """A tokenizer produces ids the model has no embedding row for."""


class ConfigurationMismatchError(PretrainedError):
    """Pretrained weights computed by another configuration than the model they should start."""


class DamagedFileError(PretrainedError):
    """A file of a model directory that cannot be read as what it should be (cut short, not
    safetensors or JSON, too large to be what it claims, or missing where its index points)."""


class ConfigValueError(PretrainedError):
    """A config.json field whose value no model can have (not a positive size, or larger than
    the weights present), refused before anything is allocated."""
