"""RoutedExperts on 8 fake CPU devices (expert 4 x fsdp 2) computes what one device does.

One subprocess runs the block (DeepSeek-V3's routing: sigmoid scores, groups, the
correction bias, a shared expert) on one device and on the mesh, for each way of
grouped matmul (expert tiles, ragged_dot), and compares the outputs and the gradients
of every parameter and of the input. (Capacity routing shares MoEBlock's dispatch, whose
meshes dew-objectives' test_mesh_expert_sequence holds to one device.)
"""

from __future__ import annotations

import json

import pytest

from dew.testing.processes import run_python

PROGRAM = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import linen as nn
from dew.nn.experts import RoutedExperts
from dew.nn.moe import moe_statistics
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec, build_mesh

block = RoutedExperts(experts=8, hidden_features=12, experts_per_token=3, scoring="sigmoid",
                      routed_scale=2.5, groups=4, groups_per_token=2, score_correction=True,
                      shared_features=8)
x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 6, 16)), jnp.float32)
boxed = jax.eval_shape(block.init, jax.random.key(0), x)
rng = np.random.default_rng(1)
params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.25, jnp.float32),
                      nn.meta.unbox(boxed))["params"]

mesh = build_mesh(MeshSpec(expert=4, fsdp=2))
layout = Layout(min_shard=0)
placement = layout.shardings(mesh, boxed)["params"]
out = {}
for name, way in {"tiles": block, "ragged_dot": block.clone(grouped_matmul="ragged_dot")}.items():
    def loss(params, x, way=way):
        y, sown = way.apply({"params": params}, x, mutable=["moe"])
        stats = moe_statistics(sown)
        return jnp.sum(jnp.sin(y)) + stats["load_balancing_loss"] + stats["router_z_loss"], y

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (one_loss, one_y), one_grads = jax.jit(step)(params, x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(layout.axis_rules):
        placed = jax.device_put(params, placement)
        (loss_value, y), grads = jax.jit(step)(placed, x)
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(tree)])
    out[name] = {"y": float(np.max(np.abs(np.asarray(y) - np.asarray(one_y)))),
                 "grads": float(np.max(np.abs(flat(grads) - flat(one_grads)))),
                 "scale": float(np.max(np.abs(flat(one_grads)))),
                 "loss": [float(loss_value), float(one_loss)],
                 "wi": str(placed["wi"].sharding.spec), "devices": len(placed["wi"].sharding.device_set)}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_expert_axis_four_with_fsdp_computes_what_one_device_does():
    result = run_python(PROGRAM, devices=8, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    for name, found in out.items():
        # Outputs within 1e-5; gradients within 1e-5 of the largest one (they reach ~10).
        assert found["y"] < 1e-5 and found["grads"] < 1e-5 * max(1.0, found["scale"]), (name, found)
        # The loss sums 768 sines: a sharded sum adds them in another order.
        assert found["loss"][0] == pytest.approx(found["loss"][1], abs=1e-4), name
        # The experts really are split: four ways over 'expert', their width over fsdp.
        assert found["wi"].startswith("P('expert', 'fsdp'") and found["devices"] == 8, found["wi"]
