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
