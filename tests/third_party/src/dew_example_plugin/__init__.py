"""An example third-party dew plugin.

Each part lives in its own module and is found by dew through the entry points
in pyproject.toml; importing this package imports none of them.
"""

__all__: list[str] = []
