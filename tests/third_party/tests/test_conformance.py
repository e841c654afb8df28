"""The plugin's model, objective and tracker pass dew's conformance kits (dew.testing).

The kits' subclasses live in the package (dew_example_plugin.conformance), where
``dew check-plugin`` finds them through the ``dew.conformance`` entry points;
importing them here lets pytest collect the same checks: run ``pytest tests/``
with the plugin installed beside dew-core.
"""

from __future__ import annotations

from dew_example_plugin.conformance import (
    TestJsonLinesTracker,
    TestRegressionObjective,
    TestRegressor,
)

__all__ = ["TestJsonLinesTracker", "TestRegressionObjective", "TestRegressor"]
