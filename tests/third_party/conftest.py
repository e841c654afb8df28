"""The plugin's tests import the installed plugin: where it is not installed (dew's own suite
walking tests/), they are not collected; tests/test_third_party.py runs them after installing it."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("dew_example_plugin") else ["tests"]
