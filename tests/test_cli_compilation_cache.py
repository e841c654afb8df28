"""`dew train` keeps compiled programs in a private user cache unless told otherwise."""

from __future__ import annotations

import os
import stat
import subprocess

import jax
import pytest

from dew.cli.compilation_cache import (
    SharedCacheDirectoryError,
    default_compilation_cache,
    private_directory,
    user_cache_directory,
)
from test_cli import DEW  # every test folder is on sys.path (conftest.py)


@pytest.fixture
def no_jax_cache():
    """JAX told of no cache (the suite's conftest names one), restored afterwards."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_default_cache_is_created_owner_only_under_xdg_cache_home(tmp_path, monkeypatch, no_jax_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("DEW_COMPILATION_CACHE", raising=False)
    with default_compilation_cache(None) as directory:
        assert directory == tmp_path / "dew" / "compilation" == user_cache_directory()
        assert jax.config.jax_compilation_cache_dir == str(directory)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert jax.config.jax_compilation_cache_dir is None  # restored on the way out


def test_a_recipes_own_cache_jaxs_own_or_off_leave_the_settings_alone(tmp_path, monkeypatch, no_jax_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with default_compilation_cache("/somewhere/else") as directory:
        assert directory is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("DEW_COMPILATION_CACHE", "off")
    with default_compilation_cache(None) as directory:
        assert directory is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv("DEW_COMPILATION_CACHE")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    with default_compilation_cache(None) as directory:
        assert directory is None and jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert not (tmp_path / "dew").exists()


def test_a_cache_directory_others_may_write_into_is_refused_with_the_fix(tmp_path):
    shared = tmp_path / "compilation"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o775)
    with pytest.raises(SharedCacheDirectoryError, match=r"not private .*mode 775.*chmod 700"):
        private_directory(shared)
    os.chmod(shared, 0o700)
    assert private_directory(shared) == shared
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(SharedCacheDirectoryError, match="not a directory"):
        private_directory(link)


@pytest.mark.slow  # one tiny-lm training through the installed console script
def test_dew_train_fills_the_private_cache_by_default(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache"))
    for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "DEW_COMPILATION_CACHE"):
        env.pop(name, None)
    result = subprocess.run(
        [str(DEW), "train", "tiny-lm", "trainer.steps=2", "data.files={stdlib}/a*.py",
         f"trackers.0.directory={tmp_path}/runs", "model.num_layers=1"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    cache = tmp_path / "cache" / "dew" / "compilation"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert any(path.name.startswith("jit_") for path in cache.iterdir())  # the step, at least


def test_a_default_cache_that_cannot_be_made_is_skipped_in_one_line(tmp_path, monkeypatch, no_jax_cache, capsys):
    """A read-only (or full) home stopped every dew train with a traceback, though the cache is
    only a speed-up."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "afile"))  # its folders cannot be made
    monkeypatch.delenv("DEW_COMPILATION_CACHE", raising=False)
    with default_compilation_cache(None) as directory:
        assert directory is None and jax.config.jax_compilation_cache_dir is None
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"dew: the compilation cache {tmp_path}/afile/dew/compilation "
                                                 "cannot be made (") and "training without it" in said[0]


def test_entries_a_full_disk_left_empty_are_removed_when_the_cache_opens(tmp_path, monkeypatch, no_jax_cache):
    """JAX writes an entry in place and never rewrites one that exists: an empty one (the disk was
    full) made every later run warn and compile that program again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("DEW_COMPILATION_CACHE", raising=False)
    cache = private_directory(user_cache_directory())
    (cache / "jit_step-abc-cache").write_bytes(b"")
    (cache / "jit_step-abc-atime").write_bytes(b"12")
    (cache / "jit_init-def-cache").write_bytes(b"compiled")
    with default_compilation_cache(None):
        assert sorted(p.name for p in cache.iterdir()) == ["jit_init-def-cache", "jit_step-abc-atime"]
