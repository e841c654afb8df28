"""What generation refuses, each error named for what is wrong."""

from __future__ import annotations

__all__ = ["EngineConfigError", "InvalidPromptError", "InvalidVariablesError", "NotPagedModelError",
           "PromptTooLongError"]


class InvalidPromptError(ValueError):
    """The prompts are not a batch of non-empty token-id sequences."""


class PromptTooLongError(ValueError):
    """A prompt plus the tokens to generate would not fit in the cache (the model's max_seq_len)."""


class EngineConfigError(ValueError):
    """An EngineConfig setting is out of range, or cannot hold one sequence of the model."""


class NotPagedModelError(TypeError):
    """The model has no attention layer that decodes through a paged cache."""


class InvalidVariablesError(TypeError):
    """What was passed as the model's variables is not its full variables ({'params': ...})."""
