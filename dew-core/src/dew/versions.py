"""Which dew is installed: the version of each of its four distributions.

A run records them with every checkpoint step (its meta's ``dew``), so a
resume or a refusal can say which dew wrote a step when it is not this one.

>>> sorted(installed())[:1]
['dew-core']
>>> described({"dew-core": "0.2.0", "dew-data": "0.2.0"})
'dew-core 0.2.0, dew-data 0.2.0'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata

__all__ = ["DISTRIBUTIONS", "component_versions", "described", "installed", "not_installed", "writer"]

DISTRIBUTIONS = ("dew-core", "dew-objectives", "dew-trackers", "dew-data")


def installed(names: Iterable[str] = DISTRIBUTIONS) -> dict[str, str]:
    """Each installed distribution's version, by name (one not installed is left out); by default
    dew's own four."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def described(versions: Mapping[str, object]) -> str:
    """versions as one phrase: ``dew-core 0.2.0, dew-objectives 0.2.0``."""
    return ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))


def writer(meta: object) -> dict[str, str] | None:
    """The dew versions a checkpoint step's meta records as its writer (None: it records none)."""
    written = meta.get("dew") if isinstance(meta, Mapping) else None
    if isinstance(written, Mapping) and written and all(isinstance(v, str) for v in written.values()):
        return dict(written)
    return None


def not_installed(written: Mapping[str, str] | None) -> bool:
    """Whether written names a dew other than the one installed here."""
    now = installed()
    return bool(written) and any(now.get(name) != version for name, version in (written or {}).items())


def component_versions(named: Sequence[tuple[str, object]]) -> dict[str, str]:
    """Which installed distribution (and version) registers each (group, name) a run names, as
    "group/name": "distribution version": what a reader of the run must have installed."""
    from dew import registry as registries

    found: dict[str, str] = {}
    for group, name in named:
        if not isinstance(name, str) or name not in registries.registry(group):
            continue
        distribution = registries.registry(group).provider(name).distribution
        try:
            version = metadata.version(distribution)
        except (metadata.PackageNotFoundError, ValueError):
            continue  # a registration made in code (a test's), not by an installed distribution
        found[f"{group}/{name}"] = f"{distribution} {version}"
    return found
