"""Weights in and out of dew, in the format their architecture is published in.

``Pretrained(model, variables, tokenizer).save(directory)`` writes a
CausalTransformer as Hugging Face's Llama (config.json, model.safetensors,
tokenizer.json); ``Pretrained.load(directory)`` reads such a directory,
whether dew or transformers wrote it.
"""

from dew.pretrained.errors import (
    ConfigurationMismatchError,
    NoExactCounterpartError,
    NoPretrainedModelError,
    PretrainedError,
    TensorMismatchError,
    UnsupportedArchitectureError,
    VocabularyMismatchError,
)
from dew.pretrained.llama import SUPPORTED
from dew.pretrained.model import CONFIG_FILE, Pretrained, check_vocabulary

__all__ = [
    "CONFIG_FILE",
    "SUPPORTED",
    "ConfigurationMismatchError",
    "NoExactCounterpartError",
    "NoPretrainedModelError",
    "Pretrained",
    "PretrainedError",
    "TensorMismatchError",
    "UnsupportedArchitectureError",
    "VocabularyMismatchError",
    "check_vocabulary",
]
