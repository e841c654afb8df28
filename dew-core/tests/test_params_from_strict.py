"""A parameters-only start from another run's checkpoint (ParamsFrom, a recipe's init.run) is read
strictly: the checkpoint's leaves must be the model's, path for path and shape for shape, and of a
floating dtype where the model keeps floats. Without these checks Orbax's partial restore reads each
case below without a word (issue 37: every tensor read into dew is checked against its tree)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.checkpoints.manager import Checkpoints
from dew.data.base import DataPartition
from dew.training.initializers import InitializerMismatchError, ParamsFrom
from dew.training.state import Scaler, TrainState


def _saved(directory, params) -> None:
    """A committed step 1 of a run whose parameters are params."""
    state = TrainState(params=params, opt_state=(), key=jax.random.key_data(jax.random.key(0)),
                       step=jnp.int32(1), microstep=jnp.int32(0), updates=jnp.int32(1), ema=None,
                       scaler=Scaler.create(), window=None)
    checkpoints = Checkpoints(directory)
    checkpoints.save(1, state, position=b"", partition=DataPartition(), meta={})
    checkpoints.wait()
    checkpoints.close()


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    params = {"params": {"embed": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                         "gate": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
                         "head": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)}}
    _saved(directory, params)
    return directory, jax.device_get(params)


def test_the_same_tree_is_read_bit_for_bit(run):
    directory, params = run
    read = ParamsFrom(directory)(_abstract(params))
    jax.tree.map(np.testing.assert_array_equal, read, params)


def test_weights_are_read_in_the_dtypes_the_model_declares(run, tmp_path):
    """A run trained in bfloat16 started a float32 recipe in bfloat16 (and a float32 run a bfloat16
    one in float32): init.run kept the stored dtype where Pretrained.load casts to param_dtype."""
    directory, params = run
    as_bf16 = _abstract(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    read = ParamsFrom(directory)(as_bf16)
    assert {leaf.dtype for leaf in jax.tree.leaves(read)} == {jnp.dtype(jnp.bfloat16)}
    jax.tree.map(lambda got, stored: np.testing.assert_array_equal(got, stored.astype(jnp.bfloat16)), read, params)
    narrow = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    _saved(tmp_path, narrow)
    wide = ParamsFrom(tmp_path)(_abstract(params))
    assert {leaf.dtype for leaf in jax.tree.leaves(wide)} == {jnp.dtype(jnp.float32)}
    jax.tree.map(lambda got, stored: np.testing.assert_array_equal(got, np.float32(stored)), wide,
                 jax.device_get(narrow))


def test_a_model_of_another_architecture_is_refused_naming_missing_and_extra_leaves(run):
    directory, params = run
    other = {"params": {"embed": params["params"]["embed"], "head": params["params"]["head"],
                        "position": np.zeros((16, 4), np.float32)}}  # no gate; a position table
    with pytest.raises(InitializerMismatchError) as refused:
        ParamsFrom(directory)(_abstract(other))
    message = str(refused.value)
    assert "params/position: missing (expected shape (16, 4))" in message
    assert "params/gate: not in the objective's variables" in message
    assert str(directory) in message


def test_a_leaf_of_another_shape_is_refused_naming_both_shapes(run):
    directory, params = run
    wider = {"params": {**params["params"], "head": np.zeros((4, 9), np.float32)}}
    with pytest.raises(InitializerMismatchError, match=r"params/head: shape \(4, 8\), expected \(4, 9\)"):
        ParamsFrom(directory)(_abstract(wider))


def test_an_integer_leaf_where_the_model_keeps_floats_is_refused(tmp_path):
    params = {"params": {"w": jnp.arange(12, dtype=jnp.int32).reshape(3, 4)}}
    _saved(tmp_path / "ints", params)
    expected = {"params": {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32)}}
    with pytest.raises(InitializerMismatchError, match=r"params/w: int32, expected float32"):
        ParamsFrom(tmp_path / "ints")(expected)


def test_named_leaves_are_left_to_the_fresh_init_and_unread(run):
    """What the user names in ignore may be missing (it starts fresh) or left over (it is not read);
    every other leaf is still read bit for bit and still checked."""
    from dew.training.initializers import IgnoringLeaves

    directory, params = run
    other = {"params": {"embed": params["params"]["embed"], "head": params["params"]["head"],
                        "position": np.zeros((16, 4), np.float32)}}  # no gate; a position table
    fresh = {"params": {"embed": np.ones((8, 4), np.float32), "head": np.ones((4, 8), np.float32),
                        "position": np.full((16, 4), 7.0, np.float32)}}
    ignore = ("params/position", "params/gate*")
    source = IgnoringLeaves(ParamsFrom(directory, ignore=ignore), ignore, fresh=lambda: fresh)
    read = source(_abstract(other))
    assert sorted(read["params"]) == ["embed", "head", "position"]
    np.testing.assert_array_equal(read["params"]["embed"], params["params"]["embed"])
    np.testing.assert_array_equal(read["params"]["head"], params["params"]["head"])
    np.testing.assert_array_equal(read["params"]["position"], fresh["params"]["position"])
    with pytest.raises(InitializerMismatchError, match="params/position: missing"):  # gate alone is not enough
        IgnoringLeaves(ParamsFrom(directory, ignore=("params/gate",)), ("params/gate",),
                       fresh=lambda: fresh)(_abstract(other))


def test_a_model_kept_beside_others_is_read_from_under_its_key_and_pointed_at_when_not_named(tmp_path):
    """A distillation run keeps params/student beside params/teacher; init.within names which one a
    new run starts from, and reading the whole tree points at the key that fits."""
    rng = np.random.default_rng(1)
    student = {"embed": rng.normal(size=(8, 4)).astype(np.float32), "head": rng.normal(size=(4, 8)).astype(np.float32)}
    teacher = {"embed": rng.normal(size=(8, 6)).astype(np.float32), "head": rng.normal(size=(6, 8)).astype(np.float32)}
    _saved(tmp_path, {"params": {"student": student, "teacher": teacher}})
    wanted = _abstract({"params": student})
    read = ParamsFrom(tmp_path, within="student")(wanted)
    jax.tree.map(np.testing.assert_array_equal, read, {"params": student})
    read = ParamsFrom(tmp_path, within="teacher")(_abstract({"params": teacher}))
    jax.tree.map(np.testing.assert_array_equal, read, {"params": teacher})
    with pytest.raises(InitializerMismatchError, match="side by side .student fits this model.*init.within=student"):
        ParamsFrom(tmp_path)(wanted)
    with pytest.raises(InitializerMismatchError, match="nothing under 'pupil'.*student, teacher"):
        ParamsFrom(tmp_path, within="pupil")(wanted)
    with pytest.raises(InitializerMismatchError, match="params/embed: shape .8, 6., expected .8, 4."):
        ParamsFrom(tmp_path, within="teacher")(wanted)
