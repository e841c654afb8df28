"""Checkpoints on their own: round trip, retention, corruption, guards, positions, placement."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.checkpoints.errors import (
    CheckpointCorruptedError,
    CheckpointMetaMismatchError,
    CheckpointNotFoundError,
    CheckpointTreeMismatchError,
    LocalStepsOwnedError,
    PositionShareMismatchError,
    require_same_meta,
)
from dew.checkpoints.manager import Checkpoints
from dew.checkpoints.manifest import render_manifest
from dew.data.base import GLOBAL_POSITION, DataPartition
from dew.training.state import Scaler, TrainState, Window

SINGLE = DataPartition()


def full_state(seed: int = 0, width: int = 16) -> TrainState:
    """A TrainState with every field filled, values depending on seed."""
    rng = np.random.default_rng(seed)
    params = {
        "params": {"w": jnp.asarray(rng.normal(size=(width, width)), jnp.float32),
                   "b": jnp.asarray(rng.normal(size=(width,)), jnp.bfloat16)},
        "batch_stats": {"mean": jnp.asarray(rng.normal(size=(width,)), jnp.float32)},
    }
    averaged = jax.tree.map(lambda x: x * 0.5, params)
    return TrainState(
        params=params,
        opt_state=({"mu": jax.tree.map(jnp.ones_like, params["params"])}, jnp.asarray(seed, jnp.int32)),
        key=jax.random.key_data(jax.random.key(seed)),
        step=jnp.asarray(seed + 3, jnp.int32),
        microstep=jnp.asarray(seed + 5, jnp.int32),
        updates=jnp.asarray(seed + 2, jnp.int32),
        ema=averaged,
        scaler=Scaler.create(2.0**10, growth_interval=7).replace(streak=jnp.asarray(seed + 4, jnp.int32)),
        window=Window(grads=jax.tree.map(lambda x: x + 1, params), count=jnp.asarray(9, jnp.int32),
                      filled=jnp.asarray(1, jnp.int32)),
    )


def template_of(state: TrainState) -> TrainState:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_same(restored: TrainState, expected: TrainState) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(expected),
                            strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def reseal(manifest: dict) -> bytes:
    """A manifest's bytes with its own digest recomputed, as if dew had written it so."""
    return render_manifest({k: v for k, v in manifest.items() if k not in ("format", "digest")})


def save(checkpoints: Checkpoints, step: int, state: TrainState, position: bytes | None = None, **meta) -> None:
    checkpoints.save(step, state, position=position, partition=SINGLE, meta=meta)


def test_round_trip_every_field(tmp_path: Path) -> None:
    state = full_state(1)
    checkpoints = Checkpoints(tmp_path / "run")
    assert checkpoints.latest is None
    save(checkpoints, 4, state, b"batch-17", accumulation=2, scaler={"growth_interval": 7})
    checkpoints.wait()
    assert checkpoints.latest == 4
    assert checkpoints.path(4) == tmp_path / "run" / "4" and checkpoints.path(4).is_dir()
    restored = Checkpoints(tmp_path / "run").restore(template_of(state), partition=SINGLE)
    assert restored.step == 4 and restored.position == b"batch-17"
    assert restored.meta == {"accumulation": 2, "scaler": {"growth_interval": 7}}
    assert_same(restored.state, state)
    assert restored.state.scaler.growth_interval == 7
    assert not (tmp_path / "run" / "run.json").exists()
    checkpoints.close()


def test_none_fields_and_relative_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    state = full_state(2).replace(ema=None, scaler=None, window=None)
    checkpoints = Checkpoints("relative")
    assert checkpoints.directory == tmp_path / "relative"
    save(checkpoints, 1, state)
    checkpoints.wait()
    restored = checkpoints.restore(template_of(state), partition=SINGLE)
    assert restored.position is None and restored.state.window is None
    assert_same(restored.state, state)


def test_retention_keeps_the_newest_and_cleans_half_written(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        save(checkpoints, step, full_state(step))
    checkpoints.wait()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3, 4]
    checkpoints.close()
    (tmp_path / "5.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    reopened = Checkpoints(tmp_path, keep=2)
    assert reopened.latest == 4
    assert (tmp_path / "5.orbax-checkpoint-tmp").exists()  # a reader leaves a writer's step alone
    reopened.acquire()  # the writer cleans it
    assert not (tmp_path / "5.orbax-checkpoint-tmp").exists()
    assert_same(reopened.restore(template_of(full_state(4)), partition=SINGLE).state, full_state(4))


def test_a_write_past_the_file_size_limit_is_told_to_raise_it_not_to_free_disk_space(tmp_path: Path) -> None:
    """A save under `ulimit -f` failed with EFBIG and was told to free disk space or fix permissions,
    neither of which was wrong; the limit is named, in either form Orbax passes the error on."""
    import errno

    from dew.checkpoints.errors import CheckpointWriteError

    for cause in (OSError(errno.EFBIG, "File too large"),
                  ValueError("Failed to write 1966080 bytes to file 16: File too large [os_error_code='27']")):
        said = str(CheckpointWriteError(16, tmp_path, cause))
        assert "ulimit -f unlimited" in said and "Free disk space" not in said, said
    said = str(CheckpointWriteError(16, tmp_path, OSError(errno.ENOSPC, "No space left on device")))
    assert "Free disk space" in said and "ulimit" not in said


def test_a_committed_step_removed_by_hand_is_a_warning_and_the_saves_go_on(tmp_path: Path) -> None:
    """The newest step deleted while the run trained failed the run at its next save, as 'Saving
    checkpoint step 40 failed ... Free disk space or fix the directory's permissions': it had been
    written, and the run's state was whole in memory."""
    import time

    from dew.checkpoints.errors import CheckpointRemovedWarning

    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 1, full_state(1))
    save(checkpoints, 2, full_state(2))
    began = time.monotonic()
    while not (tmp_path / "2").is_dir() and time.monotonic() - began < 60:  # Orbax's writer commits it
        time.sleep(0.01)
    shutil.rmtree(tmp_path / "2")
    with pytest.warns(CheckpointRemovedWarning, match=r"step 2 was written into .* and is gone from it"):
        save(checkpoints, 3, full_state(3))
    checkpoints.wait()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1, 3]
    checkpoints.close()


def test_retention_removes_a_linked_step_and_never_what_it_links_to(tmp_path: Path) -> None:
    # A shared run whose step folder links elsewhere: pruning it raised a bare OSError at every
    # resume (rmtree refuses links, after the step was renamed) and left the link behind.
    run, outside = tmp_path / "run", tmp_path / "outside"
    checkpoints = Checkpoints(run, keep=2)
    save(checkpoints, 1, full_state(1))
    checkpoints.close()
    shutil.copytree(run / "1", outside)
    (outside / "CANARY").write_text("mine")
    shutil.rmtree(run / "1")
    (run / "1").symlink_to(outside, target_is_directory=True)
    checkpoints = Checkpoints(run, keep=2)
    assert_same(checkpoints.restore(template_of(full_state(1)), partition=SINGLE).state, full_state(1))
    for step in (2, 3):
        save(checkpoints, step, full_state(step))
    checkpoints.wait()
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["2", "3"]
    assert not any(p.is_symlink() for p in run.iterdir())
    assert (outside / "CANARY").read_text() == "mine" and (outside / "state").is_dir()
    checkpoints.close()


def test_saving_a_committed_step_again_is_skipped(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2, full_state(2))
    save(checkpoints, 2, full_state(5))
    checkpoints.wait()
    assert_same(checkpoints.restore(template_of(full_state(0)), partition=SINGLE).state, full_state(2))


def test_meta_must_be_json(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="JSON"):
        save(Checkpoints(tmp_path), 1, full_state(), bad=object())


def test_missing_steps_are_named(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        checkpoints.restore(template_of(full_state()), partition=SINGLE)
    save(checkpoints, 3, full_state())
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 .* steps \[3\]"):
        checkpoints.restore(template_of(full_state()), partition=SINGLE, step=7)


def test_tree_mismatch_names_the_leaves(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 1, full_state(width=16))
    other = full_state(width=8)
    other = other.replace(params={**other.params, "extra": {"z": jnp.zeros(2)}})
    with pytest.raises(CheckpointTreeMismatchError) as caught:
        checkpoints.restore(template_of(other), partition=SINGLE)
    message = str(caught.value)
    assert "['params']['w'] was saved as float32[16, 16], the state has float32[8, 8]" in message
    assert "['extra']['z'] is in the state but not in the checkpoint" in message


def test_a_changed_dtype_is_one_line_not_one_per_leaf(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    state = full_state()
    save(checkpoints, 1, state)
    narrowed = jax.tree.map(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x, state)
    float32_leaves = sum(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state))
    with pytest.raises(CheckpointTreeMismatchError) as caught:
        checkpoints.restore(template_of(narrowed), partition=SINGLE)
    message = str(caught.value)
    assert f"{float32_leaves} leaves were saved as float32 and the state has them as float16" in message
    assert "(.params['batch_stats']['mean'], .params['params']['w'], ...)" in message  # the weights first
    assert "param_dtype" in message and "was saved as float32[" not in message
    assert len(caught.value.differences) == 1


def test_meta_guard_names_fields() -> None:
    require_same_meta(3, {"accumulation": 2, "scaler": [1, 2]}, {"accumulation": 2, "scaler": (1, 2)})
    with pytest.raises(CheckpointMetaMismatchError, match="accumulation: saved 2, now 4"):
        require_same_meta(3, {"accumulation": 2}, {"accumulation": 4})


def test_positions_belong_to_their_share(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    state = full_state()
    checkpoints.save(1, state, position=b"offset-3", partition=DataPartition(share=1, shares=2), meta={})
    checkpoints.wait()
    restored = checkpoints.restore(template_of(state), partition=DataPartition(share=1, shares=2))
    assert restored.position == b"offset-3"
    with pytest.raises(PositionShareMismatchError, match=r"shares \[1\] of 2, but this process reads share 0 of 1"):
        checkpoints.restore(template_of(state), partition=SINGLE)
    everywhere = GLOBAL_POSITION + b"1024"
    checkpoints.save(2, state, position=everywhere, partition=DataPartition(share=1, shares=2), meta={})
    assert checkpoints.restore(template_of(state), partition=DataPartition(share=0, shares=3)).position == everywhere


def _step_files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def _corrupt(directory: Path, how: str) -> Path:
    if how == "flip":
        target = max(_step_files(directory), key=lambda p: p.stat().st_size)
        data = bytearray(target.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
        target.write_bytes(bytes(data))
    elif how == "truncate":
        target = max(_step_files(directory), key=lambda p: p.stat().st_size)
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "orbax-metadata":
        target = directory / "state" / "_METADATA"
        target.unlink()
    elif how == "manifest":
        target = directory / "dew.json"
        target.unlink()
    else:
        target = directory / "_CHECKPOINT_METADATA"
        target.unlink()
    return target


@pytest.mark.parametrize("how", ["flip", "truncate", "orbax-metadata", "manifest", "step-metadata"])
def test_corruption_is_named_and_falls_back(tmp_path: Path, how: str, capsys: pytest.CaptureFixture) -> None:
    checkpoints = Checkpoints(tmp_path, keep=None, fallback=False)
    for step in (1, 2, 3):
        save(checkpoints, step, full_state(step, width=64), f"p{step}".encode())
    checkpoints.wait()
    _corrupt(tmp_path / "2", how)
    target = _corrupt(tmp_path / "3", how)
    with pytest.raises(CheckpointCorruptedError) as caught:
        checkpoints.restore(template_of(full_state(0, width=64)), partition=SINGLE)
    error = caught.value
    assert error.step == 3 and error.good == 1 and error.file == str(target)
    assert str(target) in str(error) and "step 3 is corrupt" in str(error) and "good step is 1" in str(error)

    forgiving = Checkpoints(tmp_path, keep=None, fallback=True)
    restored = forgiving.restore(template_of(full_state(0, width=64)), partition=SINGLE)
    assert restored.step == 1 and restored.position == b"p1"
    assert_same(restored.state, full_state(1, width=64))
    stderr = capsys.readouterr().err
    assert "step 3 is corrupt" in stderr and "Restoring step 1 instead; step 3 is set aside" in stderr
    assert stderr.count("step 3 is corrupt") == 1 and "restore(..., step=" not in stderr  # taken, not advised
    assert forgiving.latest == 1  # the damaged steps are moved aside, so the run can write them again
    assert (tmp_path / "3.dew-corrupt").is_dir() and (tmp_path / "2.dew-corrupt").is_dir()
    save(forgiving, 2, full_state(7, width=64))
    forgiving.wait()
    assert forgiving.latest == 2


def test_digests_catch_what_the_files_do_not(tmp_path: Path) -> None:
    """Flipped bits with a matching file table still fail: the leaf digests are independent of the files."""
    checkpoints = Checkpoints(tmp_path, fallback=False)
    save(checkpoints, 1, full_state(1))
    save(checkpoints, 2, full_state(2))
    checkpoints.wait()
    manifest_path = tmp_path / "2" / "dew.json"
    manifest = json.loads(manifest_path.read_text())
    leaf = next(item for item in manifest["leaves"] if item["path"] == ".params['params']['w']")
    leaf["digest"] ^= 1
    manifest_path.write_bytes(reseal(manifest))  # the manifest's own digest agrees: only the leaf's differs
    with pytest.raises(CheckpointCorruptedError, match=r"leaf \.params\['params'\]\['w'\] does not match its digest"):
        checkpoints.restore(template_of(full_state()), partition=SINGLE)


def test_digest_independent_of_sharding_and_sensitive_to_each_element() -> None:
    from dew.checkpoints.integrity import digest_leaves

    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8)
    base = np.asarray(digest_leaves([x]))
    for index in [(0, 0), (3, 5), (7, 7)]:
        changed = np.asarray(digest_leaves([x.at[index].set(x[index] + 1e-6 + x[index] * 1e-7)]))
        assert (changed != base).any()
    swapped = np.asarray(digest_leaves([x.T.T.at[0, 1].set(x[1, 0]).at[1, 0].set(x[0, 1])]))
    assert (swapped != base).any()


def test_local_checkpoints_restore_first_when_newer(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path / "shared", local_directory=tmp_path / "local", local_every=2)
    save(checkpoints, 4, full_state(4))
    checkpoints.save(6, full_state(6), position=b"six", partition=SINGLE, meta={}, local=True)
    checkpoints.wait()
    assert checkpoints.latest == 6
    assert checkpoints.path(6) == tmp_path / "local" / "6"
    restored = checkpoints.restore(template_of(full_state()), partition=SINGLE)
    assert restored.step == 6 and restored.position == b"six"
    assert_same(restored.state, full_state(6))
    save(checkpoints, 8, full_state(8))
    assert checkpoints.restore(template_of(full_state()), partition=SINGLE).step == 8
    shutil.rmtree(tmp_path / "local")
    assert Checkpoints(tmp_path / "shared").latest == 8


def test_a_copy_of_a_run_is_refused_the_originals_local_steps(tmp_path: Path) -> None:
    """A copy resumed where the original started found the original's local folder (its path relative
    to there): it restored the original's newest local step and wrote its own beside them, which the
    original then resumed from. Once the original is gone, the copy takes the folder over."""
    original = Checkpoints(tmp_path / "original", local_directory=tmp_path / "local", local_every=2)
    save(original, 4, full_state(4))
    original.save(6, full_state(6), position=None, partition=SINGLE, meta={}, local=True)
    original.close()
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    copy = Checkpoints(tmp_path / "copy", local_directory=tmp_path / "local", local_every=2)
    with pytest.raises(LocalStepsOwnedError, match=r"local steps of the run in .*original, not of this one in "
                                                   r".*copy.*trainer.local_checkpoint_dir"):
        _ = copy.latest
    reopened = Checkpoints(tmp_path / "original", local_directory=tmp_path / "local", local_every=2)
    assert reopened.latest == 6  # the original's own
    reopened.close()
    shutil.rmtree(tmp_path / "original")
    taken = Checkpoints(tmp_path / "copy", local_directory=tmp_path / "local", local_every=2)
    assert taken.latest == 6
    taken.acquire()
    assert json.loads((tmp_path / "local" / "dew-owner.json").read_text())["checkpoint_dir"] == str(tmp_path / "copy")
    taken.close()


def test_positions_are_stored_as_given(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    raw = bytes(range(256))
    save(checkpoints, 1, full_state(), raw)
    checkpoints.wait()
    stored = json.loads((tmp_path / "1" / "dew.json").read_text())["data"]["positions"]["0"]
    assert base64.b64decode(stored) == raw


def test_a_restore_removes_the_damaged_steps_an_earlier_restore_set_aside(tmp_path: Path, capsys) -> None:
    """Each damaged step was kept whole as <step>.dew-corrupt for good: a run damaged at every restart
    (a flaky disk) kept a full copy of its state per restart."""
    checkpoints = Checkpoints(tmp_path, keep=None)
    template = template_of(full_state(0, width=64))
    for step in (1, 2, 3):
        save(checkpoints, step, full_state(step, width=64))
    checkpoints.wait()
    _corrupt(tmp_path / "3", "truncate")
    _corrupt(tmp_path / "2", "manifest")
    assert checkpoints.restore(template, partition=SINGLE).step == 1
    assert {p.name for p in tmp_path.glob("*.dew-corrupt")} == {"2.dew-corrupt", "3.dew-corrupt"}  # both kept
    save(checkpoints, 2, full_state(2, width=64))
    checkpoints.wait()
    _corrupt(tmp_path / "2", "flip")
    capsys.readouterr()
    assert checkpoints.restore(template, partition=SINGLE).step == 1
    assert [p.name for p in tmp_path.glob("*.dew-corrupt")] == ["2.dew-corrupt"]  # this restore's alone
    assert "removed the damaged step(s) an earlier restore set aside: 3.dew-corrupt" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flip", "truncate", "manifest"])
def test_whole_counts_a_steps_files_without_reading_them(tmp_path: Path, how: str) -> None:
    checkpoints = Checkpoints(tmp_path, fallback=False)
    save(checkpoints, 1, full_state(1, width=64))
    checkpoints.wait()
    assert checkpoints.whole(1) and checkpoints.intact(1)
    _corrupt(tmp_path / "1", how)
    assert not checkpoints.intact(1)
    assert checkpoints.whole(1) == (how == "flip")  # flipped bits keep every size: only reading tells


def test_a_ctrl_c_orbax_wrapped_while_reading_is_a_stop_not_a_mismatch() -> None:
    """Ctrl-C during a resume's restore came back from Orbax wrapped in its own error, which dew
    reported as a checkpoint that does not fit the model (status 2) instead of a stop (130)."""
    from dew.errors import raised_from

    def read():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as stop:
            raise ValueError("Encountered error while reading array index 0") from stop

    with pytest.raises(ValueError) as caught:
        read()
    assert raised_from(caught.value, KeyboardInterrupt)
    assert not raised_from(ValueError("Encountered error while reading array index 0"), KeyboardInterrupt)
