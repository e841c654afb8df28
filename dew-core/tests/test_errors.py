"""One error root: every error class of every installed dew module is a DewError, and the
batch-key errors the trainer, objectives and conditionings raise are one class."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import dew
from dew.errors import BatchKeyError, DewError


def _modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(dew.__path__, "dew.")]


def _errors() -> list[type[BaseException]]:
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == name and issubclass(value, BaseException):
                found.append(value)
    return found


def test_every_error_class_dew_defines_is_a_dew_error():
    errors = _errors()
    # Warnings are not errors, and Preempted is an exit (a SystemExit), which `except
    # Exception` must not catch; every other exception class has DewError above it.
    outside = [f"{e.__module__}.{e.__qualname__}" for e in errors
               if issubclass(e, Exception) and not issubclass(e, Warning)
               and not issubclass(e, DewError)]
    assert outside == []
    assert len([e for e in errors if issubclass(e, DewError)]) >= 60  # the walk saw the house


def test_dew_errors_keep_their_builtin_kind():
    from dew.checkpoints.errors import CheckpointNotFoundError
    from dew.registry import UnknownNameError
    from dew.training.placement.layout import LayoutError

    assert issubclass(LayoutError, ValueError) and issubclass(UnknownNameError, KeyError)
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    with pytest.raises(ValueError, match="shape"):
        raise BatchKeyError("batch key 'x' has shape (2,)")
    with pytest.raises(KeyError) as caught:
        raise BatchKeyError("The batch has no key 'x'.")
    assert str(caught.value) == "The batch has no key 'x'."  # not quoted as a KeyError's would be
    assert dew.DewError is DewError


def test_a_missing_or_misshapen_batch_key_is_one_error_class():
    from dew.training.placement.mesh import BatchMismatchError

    named = [BatchMismatchError]
    for module, names in (("dew.objectives.lm", ("MissingBatchKeyError", "BatchShapeError")),
                          ("dew.objectives.diffusion", ("MissingPixelsError",)),
                          ("dew.inputs", ("MissingConditionError",))):
        try:
            imported = importlib.import_module(module)
        except ImportError:  # dew-objectives is not installed: its names are not there to check
            continue
        named += [getattr(imported, name) for name in names]
    assert all(error is BatchKeyError for error in named), named
