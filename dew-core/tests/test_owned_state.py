"""A CPU-owned train state (Layout.host=("params",)): the state lives on a CPU companion of the mesh,
the optimizer transaction runs there, and the devices differentiate against a per-step snapshot.

This machine has no accelerator, so the device mesh and its companion are the same CPU devices: what
is tested is the whole code path (two programs per step, the copies between them, the frozen leaves
kept on the devices), its numbers against a device-resident run, its placements and its checkpoints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

from dew import Trainer
from dew.objectives.base import Aux, Mean
from dew.testing.doubles import Regression, regression_dataset
from dew.testing.processes import device_env, free_port
from dew.training.placement.layout import Layout, LayoutError
from dew.training.placement.mesh import CPUDeviceCountError, companion_mesh
from dew.training.trainer import StepCompositionError


def test_host_may_name_params_and_then_owns_the_whole_state():
    layout = Layout(host=("params",))
    assert layout.owns_state and layout.resident_fields == ()
    assert not Layout(host=("opt_state",)).owns_state
    with pytest.raises(LayoutError, match=r"\['parameters'\].*or 'params' for a train state the CPU owns"):
        Layout(host=("parameters",))


def test_the_companion_needs_a_cpu_device_per_accelerator_in_every_process():
    mesh = jax.make_mesh((1,), ("fsdp",))
    assert companion_mesh(mesh).devices.tolist() == mesh.devices.tolist()  # a CPU mesh is its own twin
    with pytest.raises(CPUDeviceCountError,
                       match=r"process 0: 0 CPU devices for 1 cpu devices.*"
                             r"XLA_FLAGS=--xla_force_host_platform_device_count=1"):
        companion_mesh(mesh, cpus=[])


def test_a_custom_step_cannot_be_split_between_the_devices_and_the_cpu():
    def factory(objective, optimizer):
        raise AssertionError("never built")

    with pytest.raises(StepCompositionError, match=r"Layout.host=\('params',\) splits every step in two"):
        Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), layout=Layout(host=("params",)),
                step=factory)


# Both runs clip, accumulate over two microbatches, scale the loss, keep an EMA and freeze the first
# layer's bias, so every part of the transaction runs on the CPU in the owned run; they validate at
# steps 5 and 10 (the owned run from a device copy). Resume: 5 steps, then 5 more.
PROGRAM = r"""
import json, os, tempfile
import jax, numpy as np, optax
from dew import Trainer
from dew.objectives.base import EMASpec
from dew.testing.doubles import RecordingTracker, Regression, regression_batch, regression_dataset
from dew.checkpoints.manager import Checkpoints
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec
from dew.training import owned

compiled = []  # each OwnedExecution.compile: the owned run's two-program step (one batch shape, one compile)
original = owned.OwnedExecution.compile
owned.OwnedExecution.compile = lambda self, *a, **k: compiled.append(dict(self.mesh.shape)) or original(self, *a, **k)

class Frozen(Regression):
    frozen = staticmethod(lambda path, leaf: path[-2:] == ("Dense_0", "bias"))

MESH = MeshSpec(**json.loads(os.environ["OWNED_MESH"]))

def trainer(host, tracker, checkpoints=None):
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-2))
    return Trainer(Frozen(ema=EMASpec(decay=0.9)), optimizer, key=jax.random.key(0), mesh=MESH,
                   layout=Layout(min_shard=0, tolerance=1.0, host=host), accumulation=2, dynamic_scale=True,
                   tracker=tracker, checkpoints=checkpoints)

def leaves(tree):
    return [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]

def run(host, steps, checkpoints=None):
    tracker = RecordingTracker()
    t = trainer(host, tracker, checkpoints)
    val = lambda partition: iter([regression_batch(100 + i) for i in range(2)])
    state = t.fit(regression_dataset(val=val), steps=steps, log_every=1, checkpoint_every=5, eval_every=5)
    # the training losses, then the validation losses (a run's last step always validates)
    return t, state, [v for _, v in tracker.series("train/loss")] + [v for _, v in tracker.series("val/loss")]

out = {}
for name, host in (("resident", ()), ("owned", ("params",))):
    before = len(compiled)
    t, state, losses = run(host, 10)
    out[name + "_compiles"] = len(compiled) - before
    out[name] = {"losses": losses, "params": leaves(state.params), "opt_state": leaves(state.opt_state),
                 "ema": leaves(state.ema), "window": leaves(state.window)}
    if name == "owned":
        companion = t.execution.companion
        out["companion"] = {"shape": dict(companion.shape), "mesh": dict(t.device_mesh.shape),
                            "axes": [list(companion.axis_names), list(t.device_mesh.axis_names)]}
        frozen = {"params/Dense_0/bias"}
        placed = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            name_ = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
            mesh = leaf.sharding.mesh
            placed.append([name_, mesh == companion, mesh == t.device_mesh,
                           all(d.platform == "cpu" for d in mesh.devices.flat), str(leaf.sharding.spec)])
        out["placed"] = placed
        out["frozen_resident"] = t.execution.resident["params"]["Dense_0"]["bias"].mesh == t.device_mesh
    else:
        out["resident_specs"] = [str(x.sharding.spec) for x in jax.tree.leaves(state)]
directory = tempfile.mkdtemp()
resumed = []
for steps in (5, 10):
    checkpoints = Checkpoints(directory)
    _, state, losses = run(("params",), steps, checkpoints)
    checkpoints.close()
    resumed.append(losses)
resumed = resumed[0][:5] + resumed[1][:5] + resumed[0][5:] + resumed[1][5:]  # as one run reports them
out["resumed"] = {"losses": resumed, "params": leaves(state.params), "opt_state": leaves(state.opt_state),
                  "ema": leaves(state.ema)}
print("RESULT" + json.dumps(out))
"""

TOLERANCE = 1e-6  # measured on CPU: every difference below is exactly 0, on 1 device and on 8


def _compare(stdout: str) -> dict:
    result = json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
    resident, owned, resumed = result["resident"], result["owned"], result["resumed"]
    assert len(resident["losses"]) == 10 + 2  # ten steps, then the validation loss at steps 5 and 10
    assert (result["resident_compiles"], result["owned_compiles"]) == (0, 1)
    assert owned["losses"] == pytest.approx(resident["losses"], rel=TOLERANCE, abs=TOLERANCE)
    for field in ("params", "opt_state", "ema", "window"):
        assert jax.tree.leaves(owned[field]) == pytest.approx(jax.tree.leaves(resident[field]),
                                                              rel=TOLERANCE, abs=TOLERANCE), field
    # resuming the owned run from its step-5 checkpoint equals running it through, bit for bit
    assert resumed["losses"] == owned["losses"]
    for field in ("params", "opt_state", "ema"):
        assert resumed[field] == owned[field], field
    # every leaf on the companion (the frozen bias on the device mesh), split as the resident run splits
    companion = result["companion"]
    assert companion["shape"] == companion["mesh"] and companion["axes"][0] == companion["axes"][1]
    for name, on_companion, on_mesh, on_cpu, _ in result["placed"]:
        assert on_cpu, name
        assert on_companion if "Dense_0/bias" not in name else on_mesh, name
    assert result["frozen_resident"]
    assert [spec for *_, spec in result["placed"]] == result["resident_specs"]
    return result


@pytest.mark.slow
def test_a_cpu_owned_state_trains_like_a_resident_one_on_one_device(python_in_subprocess):
    _compare(python_in_subprocess(PROGRAM, devices=1, env={"OWNED_MESH": "{}"}))


@pytest.mark.slow
def test_a_cpu_owned_state_trains_like_a_resident_one_on_eight_devices(python_in_subprocess):
    result = _compare(python_in_subprocess(PROGRAM, devices=8, env={"OWNED_MESH": json.dumps({"fsdp": 4, "tensor": 2})}))
    assert result["companion"]["shape"]["fsdp"] == 4 and result["companion"]["shape"]["tensor"] == 2
    # the model's kernels are split over fsdp and tensor, on the companion as on the devices
    assert any("fsdp" in spec or "tensor" in spec for *_, spec in result["placed"])


class Normalized(Regression):
    """Regression after a batch norm, whose running statistics the loss returns as updates."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm(use_running_average=False, momentum=0.5, use_scale=False, use_bias=False)

    def init(self, key, variables=None):
        return {**super().init(key, variables), **self.norm.init(key, jnp.zeros((1, 4)))}

    def loss(self, variables, batch, step):
        x, updates = self.norm.apply({"batch_stats": variables["batch_stats"]}, batch["x"], mutable=["batch_stats"])
        errors = (self.model.apply({"params": variables["params"]}, x) - batch["y"]) ** 2
        return Mean(errors.sum(), jnp.asarray(errors.size, jnp.float32)), Aux(updates=updates)


def test_collections_the_forward_writes_come_back_to_the_cpu_state():
    states = {}
    for name, host in (("resident", ()), ("owned", ("params",))):
        trainer = Trainer(Normalized(), optax.adam(1e-2), key=jax.random.key(0), layout=Layout(host=host))
        states[name] = trainer.fit(regression_dataset(), steps=3, log_every=1)
    resident, owned = (jax.device_get(states[n].params) for n in ("resident", "owned"))
    assert float(abs(resident["batch_stats"]["mean"]).sum()) > 0  # the statistics moved
    assert jax.tree.map(lambda a, b: (a == b).all(), resident, owned) == jax.tree.map(lambda _: True, resident)


POOL_WORKER = r"""
import json, sys
process, port, host = int(sys.argv[1]), sys.argv[2], tuple(x for x in sys.argv[3].split(",") if x)
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
import numpy as np, optax
from dew import Trainer
from dew.testing.doubles import RecordingTracker, Regression, regression_dataset
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

tracker = RecordingTracker()
trainer = Trainer(Regression(), optax.adamw(3e-2), key=jax.random.key(0), mesh=MeshSpec(fsdp=2),
                  layout=Layout(min_shard=0, tolerance=1.0, host=host), tracker=tracker)
state = trainer.fit(regression_dataset(), steps=6, log_every=1)
owners = None
if trainer.layout.owns_state:
    twin = np.vectorize(lambda d: d.process_index)
    owners = [twin(trainer.execution.companion.devices).tolist(), twin(trainer.device_mesh.devices).tolist()]
print("RESULT" + json.dumps({"losses": [v for _, v in tracker.series("train/loss")], "owners": owners}), flush=True)
"""


def _pool(script: Path, host: str) -> dict:
    port = str(free_port())
    env = device_env(2, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                      "--xla_cpu_collective_call_terminate_timeout_seconds=600"})
    workers = [subprocess.Popen([sys.executable, str(script), str(index), port, host], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for index in range(2)]
    try:
        finished = [(worker, *worker.communicate(timeout=600)) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for index, (worker, _, err) in enumerate(finished):
        assert worker.returncode == 0, f"process {index}: {err[-4000:]}"
    out = finished[0][1]  # the trainer reports on process 0
    return json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[len("RESULT"):])


@pytest.mark.slow
def test_each_process_owns_the_state_of_its_own_devices_in_a_pool(tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(POOL_WORKER)
    resident, owned = _pool(script, ""), _pool(script, "params")
    assert len(resident["losses"]) == 6
    assert owned["losses"] == pytest.approx(resident["losses"], rel=TOLERANCE, abs=TOLERANCE)
    companion, devices = owned["owners"]
    assert companion == devices  # every shard's CPU twin is in the process of its device
    assert sorted(set(jax.tree.leaves(companion))) == [0, 1]  # and the companion spans both
