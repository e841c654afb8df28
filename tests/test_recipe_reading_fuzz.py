"""Structured edits of a shipped recipe are read and validated as one error or a config, never a traceback (it validates the objectives' and data's components)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_recipe_reading import (  # every test folder is on sys.path (conftest.py)
    _SECTIONS,
    _TREES,
    TINY,
    _check_one,
    _recipe_text,
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.lists(_SECTIONS, min_size=1, max_size=3), _TREES), max_size=4))
def test_fuzz_structured_edits_of_a_real_recipe(edits, tmp_path):
    _check_one(_recipe_text(yaml.safe_load(TINY), edits), tmp_path)
