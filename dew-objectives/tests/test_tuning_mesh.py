"""Distillation, fine-tuning and JEPA on 8 fake devices (fsdp=4, tensor=2): the single-device losses,
and a resume that continues bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dew.testing.processes import shared_compilation_cache

HERE = str(Path(__file__).resolve().parent)

PROGRAM = """
import json, sys
import jax, numpy as np, optax
sys.path.insert(0, {here!r})
from tuning_helpers import small_run
from dew import Checkpoints, Trainer
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

class Losses:
    def __init__(self): self.values = []
    def log(self, scalars, step): self.values.append(float(scalars.get("train/loss", scalars.get("loss"))))
    def artifact(self, value, step): pass
    def close(self): pass

def run(mesh, steps, directory=None):
    objective, data = small_run({kind!r})
    losses = Losses()
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), mesh=MeshSpec(**mesh),
                      layout=Layout(min_shard=0, tolerance=0.25), tracker=losses,
                      checkpoints=None if directory is None else Checkpoints(directory))
    state = trainer.fit(data, steps=steps, log_every=1, checkpoint_every=None if directory is None else 2)
    return losses.values, state

out = {{}}
if {resume!r}:
    mesh = {{"fsdp": 4, "tensor": 2}}
    losses, whole = run(mesh, 4)
    run(mesh, 2, {tmp!r} + "/b")
    _, resumed = run(mesh, 4, {tmp!r} + "/b")
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        jax.device_get(whole.params), jax.device_get(resumed.params))
    ema = True if whole.ema is None else all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), jax.device_get(whole.ema), jax.device_get(resumed.ema))))
    sharded = [str(x.sharding.spec) for x in jax.tree.leaves(whole.params) if not x.sharding.is_fully_replicated]
    out = {{"losses": losses, "bitwise": all(jax.tree.leaves(same)) and ema, "sharded": len(sharded),
           "leaves": len(jax.tree.leaves(whole.params))}}
else:
    out = {{"losses": run({{}}, 4)[0]}}
print("RESULT" + json.dumps(out))
"""


def result(stdout: str) -> dict:
    return json.loads(stdout.split("RESULT", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["distillation", "sft", "jepa"])
def test_eight_devices_match_one_and_resume_bitwise(kind, python_in_subprocess, tmp_path):
    # The eight-device child builds three Trainers of one program: the second and third load
    # the first one's executable from the compilation cache instead of compiling it again.
    cache = shared_compilation_cache(tmp_path / "xla-cache")
    single = result(python_in_subprocess(PROGRAM.format(here=HERE, kind=kind, resume=False, tmp=str(tmp_path)),
                                         devices=1, timeout=600, compilation_cache=cache))
    many = result(python_in_subprocess(PROGRAM.format(here=HERE, kind=kind, resume=True, tmp=str(tmp_path)),
                                       devices=8, timeout=600, compilation_cache=cache))
    print(kind, single["losses"], many["losses"], many["sharded"], "of", many["leaves"], "leaves sharded")
    np.testing.assert_allclose(many["losses"], single["losses"], rtol=1e-4)
    assert many["sharded"] > 0  # the parameters really are split over the mesh
    assert many["bitwise"]
