"""Weights in and out of dew, in the format their architecture is published in.

``Pretrained(model, variables, tokenizer).save(directory)`` writes a
CausalTransformer in its family's Hugging Face layout (config.json,
safetensors, the tokenizer); ``Pretrained.load(directory)`` reads such a
directory, whether dew or transformers wrote it, for every family
``dew.families`` covers (``SUPPORTED`` lists their architectures).
"""

from typing import Any

from dew.pretrained.errors import (
    ConfigurationMismatchError,
    ConfigValueError,
    DamagedFileError,
    NoExactCounterpartError,
    NoPretrainedModelError,
    PretrainedError,
    TensorMismatchError,
    UnsupportedArchitectureError,
    VocabularyMismatchError,
)
from dew.pretrained.model import CONFIG_FILE, Pretrained, check_vocabulary, model_from_config
from dew.pretrained.tokenizers import TokenizerFiles

__all__ = [
    "CONFIG_FILE",
    "SUPPORTED",
    "ConfigValueError",
    "ConfigurationMismatchError",
    "DamagedFileError",
    "NoExactCounterpartError",
    "NoPretrainedModelError",
    "Pretrained",
    "PretrainedError",
    "TensorMismatchError",
    "TokenizerFiles",
    "UnsupportedArchitectureError",
    "VocabularyMismatchError",
    "check_same_function",
    "check_vocabulary",
    "model_from_config",
]


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED":  # every architecture a family reads, computed on first use
        from dew.families import architectures

        return tuple(architectures())
    if name == "check_same_function":  # the families (and JAX) are imported on first use
        from dew.families import check_same_function

        return check_same_function
    raise AttributeError(f"module 'dew.pretrained' has no attribute {name!r}")
