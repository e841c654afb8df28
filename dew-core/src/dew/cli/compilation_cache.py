"""``dew train``'s persistent compilation cache: on by default, in a private user directory.

A recipe opts in with ``trainer.compilation_cache_dir``; a run from the command
line gets one anyway, so its second start loads its programs instead of
compiling them again. The default lives in ``$XDG_CACHE_HOME/dew/compilation``
(``~/.cache/dew/compilation``) and must be its user's alone: JAX runs what it
loads from there, so a directory another user can write into would let them
run code as this one. ``DEW_COMPILATION_CACHE=off`` turns the default off; a
cache JAX was already told of (``JAX_COMPILATION_CACHE_DIR``) is kept.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from dew.errors import DewError

__all__ = ["OFF", "SharedCacheDirectoryError", "default_compilation_cache", "user_cache_directory"]

OFF = "DEW_COMPILATION_CACHE"  # set to "off" for no default cache


class SharedCacheDirectoryError(DewError, PermissionError):
    """The default compilation cache directory is not private to this user."""


def user_cache_directory() -> Path:
    """Where ``dew train`` keeps compiled programs unless the recipe names a place."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dew" / "compilation"


def private_directory(path: Path) -> Path:
    """path, created owner-only if missing; SharedCacheDirectoryError unless it is this
    user's and nobody else may read or write it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    found = path.lstat()
    if not stat.S_ISDIR(found.st_mode):
        raise SharedCacheDirectoryError(
            f"The compilation cache {path} is not a directory (a link or a file). Remove it, "
            f"set trainer.compilation_cache_dir, or set {OFF}=off.")
    if found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise SharedCacheDirectoryError(
            f"The compilation cache {path} is not private (owner uid {found.st_uid}, mode "
            f"{stat.S_IMODE(found.st_mode):o}); JAX runs the programs it loads from there, so "
            f"only you may read or write it. Run `chmod 700 {path}` if it is yours, set "
            f"trainer.compilation_cache_dir, or set {OFF}=off.")
    return path


@contextlib.contextmanager
def default_compilation_cache(recipe_directory: str | None) -> Iterator[Path | None]:
    """Within: JAX's persistent cache in the private user directory, unless the recipe
    names its own, JAX already has one, or ``DEW_COMPILATION_CACHE=off``. The settings
    before are restored on the way out. Yields the directory used by default, or None."""
    if recipe_directory or os.environ.get(OFF, "").lower() in ("off", "0", "false", "no"):
        yield None
        return
    import jax

    if jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]  # a flag read as JAX documents
        yield None
        return
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    from dew.training.runtime.process import use_compilation_cache

    try:
        directory = private_directory(user_cache_directory())
    except SharedCacheDirectoryError:
        raise
    except OSError as error:  # a read-only or full home: the cache is a speed-up, the run goes on without
        print(f"dew: the compilation cache {user_cache_directory()} cannot be made ({error.strerror or error}); "
              f"training without it (set trainer.compilation_cache_dir, or {OFF}=off to say nothing).",
              file=sys.stderr, flush=True)
        yield None
        return
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    use_compilation_cache(str(directory))
    reset_cache()
    try:
        yield directory
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        reset_cache()  # JAX decides once per process whether it caches; decide afresh
