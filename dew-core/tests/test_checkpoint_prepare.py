"""Checkpoints.prepare: the leaf digests compiled ahead give the numbers the host computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dew.checkpoints import integrity


def _leaves() -> list[jax.Array]:
    key = jax.random.key(7)
    return [
        jax.random.normal(key, (33, 17)),
        jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4),
        jax.random.normal(jax.random.fold_in(key, 1), (9,)).astype(jnp.bfloat16),
        jnp.asarray([True, False, True]),
        jnp.asarray(2.5),
    ]


def test_prepared_digests_equal_the_host_computation() -> None:
    leaves = _leaves()
    integrity.prepare_digests(leaves)
    future = integrity._PREPARED[integrity._signature(leaves)]
    compiled = future.result(timeout=300)  # the background compile finished without error
    expected = [integrity._host_digest(leaf) for leaf in leaves]  # numpy, from the host copies
    assert integrity.digests_as_lists(compiled(leaves)) == expected
    assert integrity.digests_as_lists(integrity.digest_leaves(leaves)) == expected


def test_whole_host_arrays_are_digested_by_numpy_as_the_device_digests_them() -> None:
    """A restore's numpy leaves went through digest_leaves, which copied every weight to the device
    and reduced it there: a run's export peaked at 3.3 times its weights."""
    import numpy as np

    leaves = _leaves() + [jnp.arange(6, dtype=jnp.int8).reshape(2, 3), jnp.full((2, 2), -3, jnp.int16)]
    arrays = [np.asarray(leaf) for leaf in leaves]
    assert integrity.host_digests(arrays) == integrity.digests_as_lists(integrity.digest_leaves(leaves))


def test_leaves_of_another_shape_are_digested_without_the_prepared_program() -> None:
    leaves = _leaves()
    integrity.prepare_digests(leaves)
    integrity._PREPARED[integrity._signature(leaves)].result(timeout=300)
    other = [jnp.ones((5, 2)), *leaves[1:]]
    assert integrity.digests_as_lists(integrity.digest_leaves(other)) == [
        integrity._host_digest(leaf) for leaf in other]


def test_a_failed_compile_leaves_saving_to_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    leaves = [jnp.full((3, 3), 4.0)]

    class Broken:
        def lower(self, *args: object) -> object:
            raise RuntimeError("no compiler today")

        def __call__(self, leaves: list[jax.Array]) -> jax.Array:
            return original(leaves)

    original = integrity._digest_all
    monkeypatch.setattr(integrity, "_digest_all", Broken())
    integrity.prepare_digests(leaves)
    with pytest.raises(RuntimeError, match="no compiler today"):
        integrity._PREPARED[integrity._signature(leaves)].result(timeout=60)
    assert integrity.digests_as_lists(integrity.digest_leaves(leaves)) == [integrity._host_digest(leaves[0])]
    integrity._PREPARED.pop(integrity._signature(leaves))


def test_an_exit_while_the_digests_compile_waits_for_them_and_keeps_its_status(tmp_path) -> None:
    """A run that fails moments after it starts exits while the digest program still compiles;
    a daemon thread inside XLA at finalization aborted the process (exit 134) about five times in
    seven. The exit now waits for the compile: the handler registered before dew (so it runs
    after dew's) finds no compile left, and the run's own status comes out."""
    import subprocess
    import sys

    script = tmp_path / "exit_now.py"
    script.write_text(
        "import atexit, sys, threading\n"
        "atexit.register(lambda: print('compiling at exit:', sum(t.name == 'dew-digest-compile' "
        "and t.is_alive() for t in threading.enumerate()), flush=True))\n"
        "import jax.numpy as jnp\n"
        "from dew.checkpoints import integrity\n"
        "integrity.prepare_digests([jnp.zeros((8, 8 + i)) for i in range(30)])\n"
        "print('started:', sum(t.name == 'dew-digest-compile' for t in threading.enumerate()), flush=True)\n"
        "sys.exit(2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "started: 1" in done.stdout and "compiling at exit: 0" in done.stdout, done.stdout
