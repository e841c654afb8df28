"""Build a registered Flax model by name: ``models.build("causal_transformer", ...)``.

The names come from the ``dew.models`` entry-point group, so a model shipped
in a third party's distribution builds exactly like dew's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dew.registry import models as _registry

if TYPE_CHECKING:
    from collections.abc import Callable

    from flax.linen import Module

__all__ = ["build", "load", "names", "registry"]

registry = _registry


def build(name: str, /, **fields: Any) -> Module:
    """Validate fields against the model's declared fields, then construct it."""
    return _registry.build(name, **fields)


def load(name: str) -> Callable[..., Module]:
    """The model class registered as name."""
    return _registry.load(name)


def names() -> dict[str, str]:
    """Every registered model name with the distribution that provides it."""
    return _registry.names()
