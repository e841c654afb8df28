"""Shared test helpers: tiny subprocess runners for many-device and many-process checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Helper modules beside the tests (fresh_venv) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_python(code: str, *, devices: int = 1, timeout: float = 300, env: dict | None = None,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter with `devices` fake CPU devices; return the result."""
    environment = dict(os.environ)
    environment["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    environment["JAX_PLATFORMS"] = "cpu"
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout, env=environment, cwd=cwd,
    )


@pytest.fixture
def python_in_subprocess():
    """Call with (code, devices=8): asserts a zero exit and returns stdout."""

    def call(code: str, devices: int = 1, **kwargs) -> str:
        result = run_python(code, devices=devices, **kwargs)
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result.stdout

    return call
