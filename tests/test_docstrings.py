"""Every example in a dew docstring runs and prints what it says (doctest)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import dew

# Modules whose import needs an optional backend that a test machine may lack
# are still collected: every extra is installed by scripts/test.
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(dew.__path__, "dew.")
    if not info.name.startswith("dew.cli.") and ".tests" not in info.name
)


# Modules whose examples build and run models (tens of seconds): the fast lane skips them.
SLOW = {"dew.nn.backbones", "dew.nn.paged_attention", "dew.sampling.engine"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in MODULES])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
