"""Step time of each mesh axis against data parallelism alone, on 8 fake CPU devices.

One interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=8 trains
the same mixture-of-experts CausalTransformer (8 experts, 2 per token) under
LMObjective on every mesh below, the data-parallel baseline first and again
last, so drift over the run shows as the two baselines differing. Each line
prints the steady-state ms per step (after the first, compiled step) and its
ratio to the baseline's mean.

On fake CPU devices every "device" shares the same cores, so the ratios say
what each axis's collectives and layout cost the compiler and runtime, not
what it saves on real accelerators: it is a sanity figure, not a speedup.

    .venv/bin/python benchmarks/mesh_bench.py [--steps 12] [--width 64] [--seq 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROGRAM = r"""
import contextlib, io, itertools, json, sys
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.training.layout import Layout
from dew.training.mesh import MeshSpec

cfg = json.loads(sys.argv[1])
model = CausalTransformer(vocab_size=256, emb_features=cfg["width"], num_layers=2, num_heads=4,
                          mlp_features=2 * cfg["width"], max_seq_len=cfg["seq"],
                          position_embedding="rotary", experts=8, experts_per_token=2)
objective = LMObjective(model, seq_len=cfg["seq"])
rows = 16
batch = {"text": np.random.default_rng(0).integers(0, 256, size=(rows, cfg["seq"] + 1)).astype(np.int32)}

class Goodput:
    record = None
    def log(self, scalars, step): pass
    def artifact(self, value, step):
        if getattr(value, "type", "") == "goodput": self.record = value
    def close(self): pass

for name, spec in cfg["meshes"]:
    tracker = Goodput()
    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=1.0), tracker=tracker)
    data = Dataset(train=lambda p: itertools.repeat(batch), batch=rows)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(data, steps=cfg["steps"], log_every=cfg["steps"])
    g = tracker.record
    step_ms = 1000 * (g.wall_seconds - g.first_step_seconds) / (cfg["steps"] - 1)
    print("ROW " + json.dumps({"name": name, "step_ms": step_ms}), flush=True)
"""

MESHES = [
    ("data=8 (baseline)", {}),
    ("fsdp=2", {"fsdp": 2}),
    ("tensor=2", {"tensor": 2}),
    ("expert=2", {"expert": 2}),
    ("expert=8", {"expert": 8}),
    ("sequence=2", {"sequence": 2}),
    ("sequence=4", {"sequence": 4}),
    ("expert=2 fsdp=2 tensor=2", {"expert": 2, "fsdp": 2, "tensor": 2}),
    ("sequence=2 fsdp=2 tensor=2", {"sequence": 2, "fsdp": 2, "tensor": 2}),
    ("data=8 (baseline again)", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    cfg = {"steps": args.steps, "width": args.width, "seq": args.seq, "meshes": MESHES}
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(cfg)], capture_output=True,
                         text=True, env=env, check=False)
    if run.returncode:
        sys.exit(run.stderr[-4000:])
    rows = [json.loads(line[4:]) for line in run.stdout.splitlines() if line.startswith("ROW ")]
    baseline = sum(r["step_ms"] for r in rows if r["name"].startswith("data=8")) / 2
    print(f"8 fake CPU devices, MoE CausalTransformer width {args.width}, seq {args.seq}, "
          f"16 rows, {args.steps} steps per mesh")
    for row in rows:
        print(f"{row['name']:<28} {row['step_ms']:8.1f} ms/step   x{row['step_ms'] / baseline:.2f} "
              "vs data parallelism")


if __name__ == "__main__":
    main()
