"""Checkpoints in child processes: another placement, kill -9 during a save, a full disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dew.checkpoints.manager import Checkpoints
from dew.data.base import DataPartition

STATE = """
import jax, jax.numpy as jnp, numpy as np
from dew.data.base import DataPartition
from dew.checkpoints.manager import Checkpoints
from dew.training.state import Scaler, TrainState

def make_state(seed, width):
    rng = np.random.default_rng(seed)
    params = {"params": {"w": jnp.asarray(rng.normal(size=(width, width)), jnp.float32)}}
    return TrainState(params=params, opt_state=(jnp.asarray(rng.normal(size=(width,)), jnp.float32),),
                      key=jax.random.key_data(jax.random.key(seed)), step=jnp.int32(seed),
                      microstep=jnp.int32(seed), updates=jnp.int32(seed), ema=params,
                      scaler=Scaler.create(), window=None)

def template(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

def same(a, b):
    return all(bool((np.asarray(x) == np.asarray(y)).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
"""
HERE: dict = {}
exec(STATE, HERE)  # the same helpers, in this process, to check what the children left


def test_restore_into_another_placement(tmp_path: Path, python_in_subprocess) -> None:
    code = STATE + f"""
from jax.sharding import NamedSharding, PartitionSpec as P
state = make_state(3, 16)
row = jax.make_mesh((8,), ("data",))
placed = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(row, P("data") if x.ndim and x.shape[0] % 8 == 0
                                                                  else P())), state)
checkpoints = Checkpoints({str(tmp_path)!r})
checkpoints.save(5, placed, position=None, partition=DataPartition(), meta={{}})
checkpoints.wait()
grid = jax.make_mesh((2, 4), ("a", "b"))
def other(x):
    spec = P("b", "a") if x.ndim == 2 else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(grid, spec))
target = jax.tree.map(other, state)
restored = Checkpoints({str(tmp_path)!r}).restore(target, partition=DataPartition()).state
assert same(restored, state)
for leaf, wanted in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert leaf.sharding == wanted.sharding, (leaf.sharding, wanted.sharding)
print("placed", restored.params["params"]["w"].sharding.spec)
"""
    assert "placed P('b', 'a')" in python_in_subprocess(code, devices=8, timeout=240)


CRASH = STATE + """
import os, signal, sys
directory, point = sys.argv[1], sys.argv[2]
checkpoints = Checkpoints(directory, keep=1)
checkpoints.save(1, make_state(1, 64), position=b"one", partition=DataPartition(), meta={})
checkpoints.wait()
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if point == "manifest":  # inside dew's last call before Orbax renames the step
    import dew.checkpoints.integrity as integrity
    integrity.file_table = die
if point == "rename":  # Orbax's commit itself
    from orbax.checkpoint._src.path import async_path
    async def rename(*a, **k):
        die()
    async_path.rename = rename
if point == "during-write":  # Orbax writes step 2 in the background; it cannot commit
    import time                  # before dew's digests are in, so holding them holds the commit
    import dew.checkpoints.integrity as integrity
    def digests(leaves):
        print("writing", flush=True)
        while True:
            time.sleep(0.01)  # until the test's kill -9
    integrity.digest_leaves = digests
if point == "prune":  # step 2 committed, step 1 renamed aside and half deleted
    import shutil
    import dew.checkpoints.store as module
    whole = shutil.rmtree
    def prune(path, ignore_errors=False):
        whole(path / "state")
        die()
    module.shutil.rmtree = prune
print("saving", flush=True)
checkpoints.save(2, make_state(2, 1024), position=b"two", partition=DataPartition(), meta={})
print("returned", flush=True)
checkpoints.wait()
print("committed", flush=True)
"""


@pytest.mark.parametrize("point", ["during-write", "manifest", "rename", "after-return", "prune"])
def test_kill_9_during_a_save_keeps_the_last_committed_step(tmp_path: Path, point: str) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    directory = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    child = subprocess.Popen([sys.executable, str(script), str(directory), point], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    # The kill goes when the child says it is at the point (during-write: its write under way
    # and held there), never after a pause that a busy machine could outlast.
    wanted = {"during-write": "writing", "after-return": "returned"}.get(point)
    for line in child.stdout:
        if wanted and line.strip() == wanted:
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr.read()[-3000:]

    expected = 2 if point == "prune" else 1
    checkpoints = Checkpoints(directory, keep=1, fallback=False)
    latest = checkpoints.latest
    checkpoints.acquire()  # the killed writer's lease is stale: taken over, its half-written step removed
    assert not [p for p in directory.iterdir() if "tmp" in p.name or "pruned" in p.name], list(directory.iterdir())
    width = 64 if latest == 1 else 1024
    restored = checkpoints.restore(HERE["template"](HERE["make_state"](0, width)), partition=DataPartition())
    assert HERE["same"](restored.state, HERE["make_state"](latest, width))
    assert restored.position == [None, b"one", b"two"][latest]
    if point != "after-return":  # there the kill may land before or after the commit; either step is whole
        assert latest == expected


FULL = STATE + """
import resource, signal, sys
directory, limit = sys.argv[1], sys.argv[2]
if limit != "tmpfs":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
checkpoints = Checkpoints(directory, keep=1)  # a failed step 2 must not cost step 1
checkpoints.save(1, make_state(1, 16), position=b"one", partition=DataPartition(), meta={})
checkpoints.wait()
print("step 1 committed", flush=True)
checkpoints.save(2, make_state(2, 1024), position=b"two", partition=DataPartition(), meta={})
checkpoints.wait()
print("step 2 committed", flush=True)
"""


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "rlimit"])
def test_full_disk_surfaces_at_wait_and_keeps_the_last_step(tmp_path: Path, how: str) -> None:
    mount = tmp_path / "disk"
    if how == "tmpfs" and not _mount_tmpfs(mount, "1m"):
        pytest.skip("mounting a tmpfs is not permitted here (the rlimit case covers a refused write)")
    try:
        directory = mount / "run"
        script = tmp_path / "full.py"
        script.write_text(FULL)
        limit = "tmpfs" if how == "tmpfs" else str(512 * 1024)
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
        child = subprocess.run([sys.executable, str(script), str(directory), limit], capture_output=True,
                               text=True, env=env, timeout=120)
        assert child.returncode not in (0, -signal.SIGKILL), child.stderr[-3000:]
        assert "step 1 committed" in child.stdout and "step 2 committed" not in child.stdout
        # Orbax's threads may log after the error; the error itself is the program's end.
        assert ("dew.checkpoints.errors.CheckpointWriteError: Saving checkpoint step 2 "
                f"into {directory} failed") in child.stderr, child.stderr[-3000:]
        checkpoints = Checkpoints(directory)
        restored = checkpoints.restore(HERE["template"](HERE["make_state"](0, 16)), partition=DataPartition())
        assert HERE["same"](restored.state, HERE["make_state"](1, 16))
        assert (checkpoints.latest, restored.position) == (1, b"one")
        checkpoints.close()
    finally:
        if how == "tmpfs":
            subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
def test_host_and_device_digests_agree_for_every_dtype_and_sharding(python_in_subprocess) -> None:
    """Restores on the CPU digest on the host (numpy), saves on the devices (XLA): the numbers must agree."""
    code = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dew.checkpoints import integrity
mesh = jax.make_mesh((2, 4), ("a", "b"))
rng = np.random.default_rng(0)
checked = 0
for dtype in ["float32", "bfloat16", "float16", "float64", "int64", "uint64", "int8", "uint16", "bool", "int32"]:
    for shape, spec in [((), P()), ((8,), P("b")), ((8, 12), P("a", "b")), ((8, 12), P(None, "a")),
                        ((4, 8, 3), P("b", None, None)), ((8, 4), P())]:
        values = rng.integers(-1000, 1000, size=shape).astype(np.float64) * 0.37
        array = jax.device_put(jnp.asarray(values).astype(dtype), NamedSharding(mesh, spec))
        device = integrity.digests_as_lists(integrity.digest_leaves([array]))[0]
        assert integrity._host_digest(array) == device, (dtype, shape, spec)
        checked += 1
print("agreed", checked)
"""
    assert "agreed 60" in python_in_subprocess(code, devices=8, timeout=240)
