"""Fresh virtual environments that see the third-party stack but none of dew's installs.

Creating a venv and installing jax into it for every test would take minutes,
so each fresh venv gets one ``.pth`` line naming a directory of symlinks to
every top-level package and ``*.dist-info`` of the running interpreter's
site-packages, except dew's own (``dew``, ``dew_*``, editable-install hooks).
dew's distributions and plugins are then installed into the venv for real,
with ``pip install --no-deps``, as wheels or editable.

Test modules load this file by path (pytest runs with ``--import-mode=importlib``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {
    "dew-core": ROOT / "dew-core",
    "dew-objectives": ROOT / "dew-objectives",
    "dew-trackers": ROOT / "dew-trackers",
    "dew-data": ROOT / "dew-data",
}

_SKIP_PREFIXES = ("dew", "__editable__", "_dew", "__pycache__")


def shared_dependencies(directory: Path) -> Path:
    """Fill directory with symlinks to the non-dew contents of this interpreter's site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    directory.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        if entry.name.lower().startswith(_SKIP_PREFIXES) or entry.suffix == ".pth":
            continue
        (directory / entry.name).symlink_to(entry)
    return directory


def build_wheels(directory: Path, *projects: Path) -> dict[str, Path]:
    """Build one wheel per project directory with ``pip wheel --no-deps``; name -> wheel."""
    directory.mkdir(parents=True, exist_ok=True)
    # Build from clean copies: an in-tree build/ directory can carry deleted modules.
    sources = directory / "sources"
    copies = []
    for project in projects:
        copy = sources / project.name
        shutil.copytree(project, copy, ignore=shutil.ignore_patterns(
            "build", "dist", "*.egg-info", "__pycache__"))
        copies.append(copy)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(directory),
         *map(str, copies)], timeout=600)
    wheels = {}
    for wheel in directory.glob("*.whl"):
        wheels[wheel.name.split("-")[0].replace("_", "-")] = wheel
    return wheels


def create(path: Path, dependencies: Path) -> Path:
    """A venv without pip whose sys.path ends with the shared dependencies; its python."""
    run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = path / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (Path(purelib.stdout.strip()) / "_dew_test_shared.pth").write_text(f"{dependencies}\n")
    return python


def install(python: Path, *requirements: str | Path, editable: bool = False) -> None:
    """pip install requirements (wheels, or project paths if editable) into the venv, no deps."""
    arguments = []
    for requirement in requirements:
        arguments += ["-e", str(requirement)] if editable else [str(requirement)]
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--quiet", *arguments], timeout=600)


def run(command: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; on failure raise with its output."""
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environment["JAX_PLATFORMS"] = "cpu"
    environment.update(kwargs.pop("env", {}))
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=environment, **kwargs)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def probe(python: Path, code: str, timeout: float = 300, **kwargs) -> dict:
    """Run code in the venv (from a neutral directory); it prints one JSON object last."""
    result = run([str(python), "-c", textwrap.dedent(code)], timeout=timeout,
                 cwd=kwargs.pop("cwd", "/"), **kwargs)
    return json.loads(result.stdout.strip().splitlines()[-1])


_SESSION: dict[str, object] = {}


def session_dependencies(root: Path) -> Path:
    """The shared-dependency directory, made once per test process under root."""
    if "dependencies" not in _SESSION:
        _SESSION["dependencies"] = shared_dependencies(root / "shared-dependencies")
    return _SESSION["dependencies"]  # type: ignore[return-value]


def session_wheels(root: Path) -> dict[str, Path]:
    """Wheels of the four distributions, built once per test process under root."""
    if "wheels" not in _SESSION:
        _SESSION["wheels"] = build_wheels(root / "wheels", *DISTRIBUTIONS.values())
    return _SESSION["wheels"]  # type: ignore[return-value]

