"""Settings and fixtures every test folder of the workspace shares.

Each distribution keeps its tests beside it (dew-core/tests, dew-objectives/tests,
dew-trackers/tests, dew-data/tests); tests of the whole house (packaging, docs,
the third-party plugin) live in tests/. This file is loaded for all of them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Strict JAX, here and in every interpreter a test starts: implicit rank
# promotion is a bug in dew, not a convenience.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"


def _compilation_cache() -> None:
    """Keep every program the suite compiles in JAX's persistent cache, here and in every
    child a test starts (they inherit the environment), so a program compiled once (by an
    earlier test, another worker or the last run of the suite) is loaded, not compiled.

    The cache lives outside the checkout, keyed by JAX's version: ``DEW_TEST_COMPILATION_CACHE``
    names another folder, or ``off`` compiles everything afresh. A test that names its own
    cache (``device_env(compilation_cache=...)``, ``trainer.compilation_cache_dir``) keeps it.

    JAX's own size limit is off: with it, every write rereads every entry of the folder
    (half a second a write at ten thousand entries, longer as the folder grows) under a
    lock two threads of one process race on. The suite bounds the folder itself, once, as
    it starts (``_trimmed``).
    """
    import importlib.metadata

    chosen = os.environ.get("DEW_TEST_COMPILATION_CACHE", "")
    if chosen.lower() == "off":
        return
    version = importlib.metadata.version("jax")
    folder = Path(chosen) if chosen else Path.home() / ".cache" / "dew" / f"test-compilation-jax-{version}"
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and folder.is_dir():
        _trimmed(folder, CACHE_LIMIT_BYTES)  # once, in the first pytest process: workers and children inherit the folder
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(folder))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")


CACHE_LIMIT_BYTES = 4 * 2**30


def _trimmed(folder: Path, limit: int) -> None:
    """Delete the folder's oldest entries (by last write) until it holds at most limit bytes,
    and the access-time files JAX's own eviction left (they are not read without it)."""
    entries = []
    for path in folder.iterdir():
        if path.name.endswith("-atime"):
            path.unlink(missing_ok=True)
        elif path.name.endswith("-cache"):
            found = path.stat()
            entries.append((found.st_mtime, found.st_size, path))
    held = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if held <= limit:
            break
        path.unlink(missing_ok=True)
        held -= size


_compilation_cache()

import pytest  # noqa: E402

from dew.testing.doubles import RecordingTracker  # noqa: E402
from dew.testing.processes import run_python  # noqa: E402

ROOT = Path(__file__).resolve().parent
TEST_FOLDERS = [ROOT / "tests", *sorted(ROOT.glob("dew-*/tests"))]
# Helper modules beside the tests (fresh_venv, mlflow_server, ...) import by name
# under --import-mode=importlib.
for folder in TEST_FOLDERS:
    sys.path.insert(0, str(folder))


@pytest.fixture
def python_in_subprocess():
    """Call with (code, devices=8): asserts a zero exit and returns stdout."""

    def call(code: str, devices: int = 1, **kwargs) -> str:
        result = run_python(code, devices=devices, **kwargs)
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result.stdout

    return call


@pytest.fixture
def dew_command(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """Call with (*args, cwd=DIRECTORY): `dew ARGS` typed in DIRECTORY, run through ``dew.cli.main`` in
    this process (the function the ``dew`` console script calls: tests/test_recipe_matrix.py checks
    they agree, exit codes included) rather than in a new interpreter; returns a CompletedProcess with
    its exit status, stdout and stderr. DEW_TRACEBACK is unset, so an error dew names is printed."""
    import subprocess

    from dew.cli import TRACEBACK, main

    def call(*args: str, cwd: str | Path) -> subprocess.CompletedProcess:
        capsys.readouterr()  # what the test printed before is not the command's
        with monkeypatch.context() as scoped:
            scoped.chdir(cwd)
            scoped.delenv(TRACEBACK, raising=False)
            code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return call


@pytest.fixture
def recorder() -> RecordingTracker:
    """A tracker that keeps every report in memory."""
    return RecordingTracker()


@pytest.fixture
def repository() -> Path:
    """The workspace root (the four distributions, docs/, scripts/, benchmarks/)."""
    return ROOT


DURATIONS = ROOT / "tests" / "durations.json"  # each module's seconds in a whole run (scripts/durations.py)
UNLISTED_SLOW_SECONDS = 30.0  # a module the table does not list yet, holding a slow test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules run longest first (each module's own order kept): the suite's workers take whole
    modules in collection order, so the long ones start early and the short ones fill the end,
    instead of one worker finishing a long module while the other stands idle. The seconds come
    from tests/durations.json; a module it does not list counts as UNLISTED_SLOW_SECONDS when it
    holds a slow test, else as nothing."""
    import json

    listed: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    slow = {item.module for item in items if item.get_closest_marker("slow") is not None}

    def seconds(item: pytest.Item) -> float:
        path = item.nodeid.split("::", 1)[0]
        return listed.get(path, UNLISTED_SLOW_SECONDS if item.module in slow else 0.0)

    items.sort(key=lambda item: -seconds(item))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap once collection has imported every test module (JAX, torch and transformers
    among them), so the garbage collector's full passes walk only what the tests make afterwards."""
    import gc

    gc.freeze()
