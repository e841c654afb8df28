"""Lazy attribute export for dew's packages.

A package that several distributions fill names each public attribute with
the module that defines it and the distribution (and extra) that ships that
module. Nothing is imported until the attribute is read, and a module that is
not installed raises MissingDistributionError saying what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class MissingDistributionError(ImportError):
    """A dew name lives in a distribution (or extra) that is not installed."""


@dataclass(frozen=True)
class Export:
    """Where one lazily exported name lives."""

    module: str
    distribution: str = "dew-core"
    extra: str | None = None
    attribute: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.distribution}[{self.extra}]" if self.extra else self.distribution


def import_from(module: str, distribution: str, extra: str | None = None):
    """Import module, turning a missing distribution into an actionable error."""
    try:
        return importlib.import_module(module)
    except (ModuleNotFoundError, MissingDistributionError) as error:
        missing = error.name or ""
        if missing == module or module.startswith(missing + ".") or missing in _BACKENDS:
            requirement = f"{distribution}[{extra}]" if extra else distribution
            raise MissingDistributionError(
                f"{module} is not installed (missing module {missing!r}). "
                f"It ships with {requirement}: pip install '{requirement}'"
            ) from error
        raise


_BACKENDS = {"tensorboard", "mlflow", "wandb", "grain", "datasets", "tokenizers", "qwix"}


def exporter(package: str, exports: Mapping[str, Export]) -> tuple[Callable, Callable]:
    """Return the (__getattr__, __dir__) pair a package uses for its lazy names."""

    def __getattr__(name: str):
        export = exports.get(name)
        if export is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = import_from(export.module, export.distribution, export.extra)
        if export.attribute == "":
            return module
        return getattr(module, export.attribute or name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__


# Subpackages that a distribution other than dew-core fills. When none of the
# import system's finders locates one of their modules, the last finder says
# which distribution to install instead of a bare ModuleNotFoundError.
_SHIPPED_BY = {
    "dew.objectives": "dew-objectives",
    "dew.sampling": "dew-objectives",
    "dew.diffusion": "dew-objectives",
    "dew.inputs": "dew-objectives",
    "dew.rewards": "dew-objectives",
    "dew.trackers": "dew-trackers",
    "dew.data": "dew-data",
}


class _MissingDistributionFinder:
    """The last entry of sys.meta_path: explains dew modules that nothing else found."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        for prefix, distribution in _SHIPPED_BY.items():
            if fullname != prefix and not fullname.startswith(prefix + "."):
                continue
            if fullname == prefix or _installed(distribution):
                return None  # the shared package itself, or a genuinely absent module
            raise MissingDistributionError(
                f"{fullname} is not installed. It ships with {distribution}: "
                f"pip install {distribution}",
                name=fullname,
            )
        return None


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install_finder() -> None:
    """Append the explaining finder to sys.meta_path once (cheap: no imports)."""
    import sys

    if not any(isinstance(f, type) and f is _MissingDistributionFinder for f in sys.meta_path):
        sys.meta_path.append(_MissingDistributionFinder)  # type: ignore[arg-type]
