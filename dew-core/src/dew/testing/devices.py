"""Run code, or one method of a kit, in a fresh interpreter that sees fake CPU devices.

JAX fixes its device count when it starts, so a check that needs eight
devices on a machine with one (a laptop, CI) runs in a child process started
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. The child gets
this interpreter's ``sys.path``, so it imports what the caller imports: the
project under test and the helper modules beside its tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dew.errors import DewError
from dew.testing.processes import run_python

__all__ = ["FakeDeviceRunError", "call_on_fake_devices", "run_on_fake_devices"]


class FakeDeviceRunError(DewError, AssertionError):
    """The child process exited with an error; the message holds the end of its output."""


def _search_path(extra: dict[str, str] | None) -> dict[str, str]:
    """extra, with a PYTHONPATH that makes the child import what this interpreter imports."""
    paths = [p for p in sys.path if p and Path(p).exists()]
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([*paths, *filter(None, [inherited])]), **(extra or {})}


def run_on_fake_devices(code: str, *, devices: int = 8, timeout: float = 300,
                        env: dict[str, str] | None = None) -> str:
    """Run code in a child interpreter that sees devices CPU devices; return its stdout.

    Raises FakeDeviceRunError (an AssertionError, so a test reports it as a
    failure) with the child's output when it exits non-zero.
    """
    if devices < 1:
        raise ValueError(f"run_on_fake_devices needs at least one device, got {devices}.")
    result = run_python(code, devices=devices, timeout=timeout, env=_search_path(env))
    if result.returncode != 0:
        tail = (result.stdout + "\n" + result.stderr).strip()[-6000:]
        raise FakeDeviceRunError(
            f"The check on {devices} fake devices exited with status {result.returncode}:\n{tail}")
    return result.stdout


_CALL = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location({module!r}, {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[{module!r}] = module
spec.loader.exec_module(module)
kit = module
for part in {qualname!r}.split("."):
    kit = getattr(kit, part)
getattr(kit(), {method!r})(*{args!r})
"""


def call_on_fake_devices(kit: type, method: str, *, devices: int = 8, timeout: float = 300,
                         args: tuple[str | int | float, ...] = ()) -> str:
    """Call ``kit().method(*args)`` in a child interpreter with devices fake CPU devices.

    kit must be a class defined at the top level of a module file (a test
    module), because the child loads it again from that file; args are
    plain values (written into the child's code with repr).
    """
    if "<locals>" in kit.__qualname__:
        raise TypeError(
            f"{kit.__qualname__} is defined inside a function; a check on fake devices loads the "
            "class again in a child process, so define it at the top level of its module.")
    module = sys.modules.get(kit.__module__)
    path = getattr(module, "__file__", None)  # a module built in memory has none
    if path is None:
        raise TypeError(f"{kit.__qualname__}'s module {kit.__module__!r} has no file to load it from.")
    code = _CALL.format(module=kit.__module__, path=str(path), qualname=kit.__qualname__, method=method,
                        args=tuple(args))
    return run_on_fake_devices(code, devices=devices, timeout=timeout)
