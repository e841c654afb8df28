"""Host offload: Layout.host keeps train-state fields in pinned host memory between steps (the CPU
backend has a pinned_host memory, so the memory kinds are real here), Layout.offloaded places
host_parameters there for inference, and check refuses them anywhere else."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from dew.training.placement.layout import HOST_MEMORY, HOST_RESIDENT, Layout, LayoutError
from dew.training.placement.mesh import MESH_AXES


def test_host_names_only_host_resident_fields():
    assert Layout(host=["opt_state"]).host == ("opt_state",)
    with pytest.raises(LayoutError, match=r"\['optimizer'\].*choose among \['opt_state', 'ema'\]"):
        Layout(host=("optimizer",))
    assert Layout(host=("params",)).owns_state  # the CPU-owned state: tests/test_owned_state.py
    assert set(HOST_RESIDENT) == {"opt_state", "ema"}


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for index in range(3):
            x = nn.Dense(8, name=f"layers_{index}")(x)
        return nn.Dense(2, name="head")(x)


def _params():
    return Stack().init(jax.random.key(0), jnp.zeros((1, 8)))


def _mesh():
    return jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES)


def test_offloaded_moves_the_matched_parameters_to_host_memory_with_the_same_spec():
    params, mesh = _params(), _mesh()
    layout = Layout(min_shard=0, host_parameters=("params/layers_*",))
    resident = layout.shardings(mesh, params)
    offloaded = layout.offloaded(mesh, params)
    for path, sharding in jax.tree_util.tree_flatten_with_path(offloaded)[0]:
        name = jax.tree_util.keystr(path)
        expected = HOST_MEMORY if "layers_" in name else "device"
        assert sharding.memory_kind == expected, name
    assert [s.spec for s in jax.tree.leaves(offloaded)] == [s.spec for s in jax.tree.leaves(resident)]
    # the weights placed there hold the same values, in host memory
    placed = jax.device_put(params, offloaded)
    kernel = placed["params"]["layers_1"]["kernel"]
    assert kernel.sharding.memory_kind == HOST_MEMORY
    assert (jax.device_get(kernel) == jax.device_get(params["params"]["layers_1"]["kernel"])).all()
    layout.check(params, offloaded, mesh)  # offloaded's own placement passes


def test_every_pattern_must_match_something():
    params, mesh = _params(), _mesh()
    with pytest.raises(LayoutError, match=r"pattern 'params/layer_\*' matches no parameter; paths look like "
                                          r"params/head/bias"):
        Layout(host_parameters=("params/layers_*", "params/layer_*")).offloaded(mesh, params)


def test_check_refuses_host_parameters_in_a_placement_that_keeps_them_on_the_devices():
    params, mesh = _params(), _mesh()
    layout = Layout(min_shard=0, host_parameters=("params/head/*",))
    with pytest.raises(LayoutError, match=r"is for an inference placement \(Layout.offloaded\)"):
        layout.check(params, layout.shardings(mesh, params), mesh)


PROGRAM = r"""
import json
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.testing.doubles import NextToken, RecordingTracker, TokenMLP, token_batches
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

def LM():
    return NextToken(TokenMLP())  # dew.testing's smallest sharded language model and its loss


out = {}
for name, host in (("resident", ()), ("offloaded", ("opt_state", "ema"))):
    losses = RecordingTracker()
    trainer = Trainer(LM(), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(fsdp=4, tensor=2),
                      layout=Layout(min_shard=0, tolerance=0.25, host=host), tracker=losses)
    state = trainer.fit(Dataset(train=token_batches, batch=16), steps=5, log_every=1)
    out[name] = {
        "losses": losses.values("train/loss"),
        "params": [np.asarray(x).tolist() for x in jax.tree.leaves(state.params)],
        "opt_state": [np.asarray(x).tolist() for x in jax.tree.leaves(state.opt_state)],
        "opt_kinds": sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}),
        "param_kinds": sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.params)}),
        "specs": [str(x.sharding.spec) for x in jax.tree.leaves(state.opt_state)],
    }
# resumed: a run stopped at step 3 restores its state (host-resident or not) and goes on; the
# token_batches generator has no data position, so both resumed runs read their batches from the start again
import tempfile
from dew.checkpoints.manager import Checkpoints
for name, host in (("resumed_resident", ()), ("resumed_offloaded", ("opt_state",))):
    directory = tempfile.mkdtemp()
    resumed = []
    for steps in (3, 5):
        losses = RecordingTracker()
        checkpoints = Checkpoints(directory)
        trainer = Trainer(LM(), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(fsdp=4, tensor=2),
                          layout=Layout(min_shard=0, tolerance=0.25, host=host), tracker=losses,
                          checkpoints=checkpoints)
        state = trainer.fit(Dataset(train=token_batches, batch=16), steps=steps, log_every=1, checkpoint_every=3)
        checkpoints.close()
        resumed += losses.values("train/loss")
    out[name] = {"losses": resumed,
                 "opt_kinds": sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_an_offloaded_optimizer_state_trains_exactly_like_a_resident_one(python_in_subprocess):
    stdout = python_in_subprocess(PROGRAM, devices=8)
    result = json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
    resident, offloaded = result["resident"], result["offloaded"]
    assert offloaded["opt_kinds"] == [HOST_MEMORY] and resident["opt_kinds"] == ["device"]
    assert offloaded["param_kinds"] == ["device"]
    assert offloaded["specs"] == resident["specs"]  # split the same way, only elsewhere
    assert len(resident["losses"]) == 5
    assert offloaded["losses"] == resident["losses"]
    assert offloaded["params"] == resident["params"] and offloaded["opt_state"] == resident["opt_state"]
    # 3 steps, then 2 more after a restore: the host-resident state restores into host memory
    assert result["resumed_offloaded"]["losses"] == result["resumed_resident"]["losses"]
    assert result["resumed_offloaded"]["losses"][:3] == resident["losses"][:3]
    assert len(result["resumed_offloaded"]["losses"]) == 5
    assert result["resumed_offloaded"]["opt_kinds"] == [HOST_MEMORY]
