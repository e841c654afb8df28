"""The expert and sequence mesh axes give the single-device losses: 8 fake CPU devices in a subprocess.

A mixture-of-experts CausalTransformer trains for 10 steps under LMObjective on one
device and on meshes that split its experts (expert=2), its positions (sequence=2),
and both beside fsdp and tensor; every run must log the same losses.
"""

from __future__ import annotations

import json

import pytest

PROGRAM = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.testing.doubles import RecordingTracker
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

SEQ, ROWS = 8, 8
model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=2, num_heads=2,
                          mlp_features=32, max_seq_len=SEQ, position_embedding="rotary",
                          experts=4, experts_per_token=2, expert_capacity=1.0)
objective = LMObjective(model, seq_len=SEQ, expert_loss_weight=0.1)

def batches(partition):
    step = 0
    while True:
        rng = np.random.default_rng(step)
        # A skewed token distribution, so the routers have something to be unbalanced by.
        rows = (rng.integers(0, 32, size=(ROWS, SEQ + 1)) % (4 + step % 5)).astype(np.int32)
        share = ROWS // partition.shares
        yield {"text": rows[partition.share * share:(partition.share + 1) * share]}
        step += 1

def pick(rows, name):
    return [float(next(v for k, v in r.items() if k.endswith(name))) for _, r in rows]

out = {}
for name, spec in json.loads(sys.argv[1]).items():
    scalars = RecordingTracker()
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=0.25), tracker=scalars)
    state = trainer.fit(Dataset(train=batches, batch=ROWS), steps=10, log_every=1)
    wi = state.params["params"]["layers_0"]["moe"]["wi"]
    mesh = trainer.device_mesh
    with jax.set_mesh(mesh), nn.logical_axis_rules(trainer.layout.axis_rules):
        hidden = jax.jit(lambda v, t: model.apply(v, t))(state.params, jnp.zeros((ROWS, SEQ), jnp.int32))
    # The trained state decodes on its mesh (one position a step, which a sequence split cannot divide).
    from dew.sampling import Sampling, generate
    greedy = generate(model, state.params, [[1, 2, 3]], 4, jax.random.key(0), Sampling(temperature=0.0))
    out[name] = {"loss": pick(scalars.rows, "/loss"), "greedy": greedy.new_tokens[0],
                 "balance": pick(scalars.rows, "load_balancing_loss"),
                 "dropped": pick(scalars.rows, "dropped_fraction"),
                 "wi": str(wi.sharding.spec), "logits": str(hidden.sharding.spec)}
print("RESULT" + json.dumps(out))
"""

def run(python_in_subprocess, meshes: dict, devices: int) -> dict:
    stdout = python_in_subprocess(
        f"import sys; sys.argv = ['x', {json.dumps(json.dumps(meshes))}]\n" + PROGRAM,
        devices=devices, timeout=540,
    )
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def single() -> dict:
    """The one-device run every mesh is held to."""
    from dew.testing.processes import run_python

    result = run_python(f"import sys; sys.argv = ['x', {json.dumps(json.dumps({'one': {}}))}]\n"
                        + PROGRAM, devices=1, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT"))
    one = json.loads(line[len("RESULT"):])["one"]
    assert len(one["loss"]) == 10
    # The routers drop tokens and are scored on their balance: the tests cover both paths.
    assert max(one["dropped"]) > 0 and min(one["balance"]) > 1.0
    return one


def same_as_one_device(sharded: dict, single: dict) -> None:
    for name, result in sharded.items():
        for key in ("loss", "balance", "dropped"):
            assert result[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.slow
def test_expert_meshes_match_one_device(python_in_subprocess, single):
    sharded = run(python_in_subprocess, {"expert2": {"expert": 2},
                                         "expert2_fsdp2_tensor2": {"expert": 2, "fsdp": 2, "tensor": 2}},
                  devices=8)
    same_as_one_device(sharded, single)
    # The experts really are split over the expert axis.
    assert sharded["expert2"]["wi"].startswith("P('expert'")
    assert "'expert'" in sharded["expert2_fsdp2_tensor2"]["wi"]


@pytest.mark.slow
def test_sequence_meshes_match_one_device(python_in_subprocess, single):
    sharded = run(python_in_subprocess, {"sequence2": {"sequence": 2},
                                         "sequence2_fsdp2_tensor2": {"sequence": 2, "fsdp": 2, "tensor": 2},
                                         "expert2_sequence2_fsdp2": {"expert": 2, "sequence": 2, "fsdp": 2}},
                  devices=8)
    same_as_one_device(sharded, single)
    # Their trained weights generate as one device's do (a sequence mesh's stopped at the end of
    # every run: the decode step's one position was held to the sequence split).
    for name, result in sharded.items():
        assert result["greedy"] == single["greedy"] and len(single["greedy"]) == 4, name
    # Positions really are split over the sequence axis (and experts beside them).
    for name in sharded:
        assert "'sequence'" in sharded[name]["logits"], name
    assert sharded["expert2_sequence2_fsdp2"]["wi"].startswith("P('expert'")


BAD_INPUT = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.nn.sharding import SequenceSplitError
from dew.objectives.lm import LMObjective
from dew.training.placement.layout import Layout, LayoutError
from dew.training.placement.mesh import MeshSizeError, MeshSpec, build_mesh

try:
    build_mesh(MeshSpec(expert=3, sequence=2))
except MeshSizeError as error:
    print("AXES", error)

def trainer(experts, seq, mesh):
    model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
                              mlp_features=32, max_seq_len=16, experts=experts)
    return Trainer(LMObjective(model, seq_len=seq), optax.sgd(0.1), key=jax.random.key(0),
                   mesh=MeshSpec(**mesh), layout=Layout(min_shard=0, tolerance=1.0))

try:
    trainer(3, 8, {"expert": 2}).place()
except LayoutError as error:
    print("EXPERTS", error)

def batches(partition):
    while True:
        yield {"text": np.zeros((8 // partition.shares, 8), np.int32)}

try:
    trainer(0, 7, {"sequence": 2}).fit(Dataset(train=batches, batch=8), steps=1)
except SequenceSplitError as error:
    print("SEQUENCE", error)
"""


def test_bad_expert_and_sequence_splits_are_refused_by_name(python_in_subprocess):
    stdout = python_in_subprocess(BAD_INPUT, devices=8, timeout=600)
    lines = {line.split(" ", 1)[0]: line for line in stdout.splitlines()}
    assert "expert=3" in lines["AXES"] and "sequence=2" in lines["AXES"] and "8 devices" in lines["AXES"]
    assert "3 experts" in lines["EXPERTS"] and "MeshSpec.expert=2" in lines["EXPERTS"]
    assert "multiple of 2" in lines["EXPERTS"]
    assert "7 positions" in lines["SEQUENCE"] and "multiple of 2" in lines["SEQUENCE"]
    assert "MeshSpec.sequence" in lines["SEQUENCE"]
