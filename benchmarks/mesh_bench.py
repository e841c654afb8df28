"""Step time of each mesh axis against data parallelism alone, on 8 fake CPU devices.

One interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=8
compiles Trainer's step for the same mixture-of-experts CausalTransformer (8
experts, 2 per token; --experts 0 for a dense one) under LMObjective on every
mesh below, then times rounds of steps that visit the meshes in turn, so the
machine's drift hits every mesh alike. Each line prints a mesh's median ms per
step over the rounds and its ratio to data parallelism alone.

On fake CPU devices every "device" shares the same cores, so the ratios say
what each axis's collectives and layout cost the compiler and runtime, not
what it saves on real accelerators: it is a sanity figure, not a speedup.

    .venv/bin/python benchmarks/mesh_bench.py [--rounds 7] [--steps 5] [--experts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from dew.cli.runs import positive

PROGRAM = r"""
import json, statistics, sys, time
import jax, numpy as np, optax
from dew import Trainer
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec, data_partition, shard_batch

cfg = json.loads(sys.argv[1])
model = CausalTransformer(vocab_size=256, emb_features=cfg["width"], num_layers=2, num_heads=4,
                          mlp_features=2 * cfg["width"], max_seq_len=cfg["seq"],
                          position_embedding="rotary", experts=cfg["experts"], experts_per_token=2)
objective = LMObjective(model, seq_len=cfg["seq"])
rows = 16
host = {"text": np.random.default_rng(0).integers(0, 256, size=(rows, cfg["seq"] + 1)).astype(np.int32)}

# Every mesh's step is compiled first; the timed rounds then visit the meshes in turn, so a
# busy moment of the machine lands on all of them, and each figure is its median round.
runs = []
for name, spec in cfg["meshes"]:
    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=1.0))
    state, _, _ = trainer.place()
    batch = shard_batch(host, trainer.device_mesh, data_partition(trainer.device_mesh))
    step = trainer.compile(state, batch)
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    runs.append({"name": name, "step": step, "state": state, "batch": batch, "ms": []})
for _ in range(cfg["rounds"]):
    for run in runs:
        began = time.perf_counter()
        for _ in range(cfg["steps"]):
            run["state"], metrics = run["step"](run["state"], run["batch"])
        jax.block_until_ready(metrics)
        run["ms"].append(1000 * (time.perf_counter() - began) / cfg["steps"])
for run in runs:
    print("ROW " + json.dumps({"name": run["name"], "step_ms": statistics.median(run["ms"])}))
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
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=positive, default=7)
    parser.add_argument("--experts", type=int, default=8, help="0 benchmarks a dense model")
    parser.add_argument("--width", type=positive, default=64)
    parser.add_argument("--seq", type=positive, default=64)
    args = parser.parse_args()
    cfg = {"steps": args.steps, "rounds": args.rounds, "width": args.width, "seq": args.seq,
           "experts": args.experts, "meshes": MESHES}
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(cfg)], capture_output=True,
                         text=True, env=env, check=False)
    if run.returncode:
        sys.exit(run.stderr[-4000:])
    rows = [json.loads(line[4:]) for line in run.stdout.splitlines() if line.startswith("ROW ")]
    baseline = rows[0]["step_ms"]
    kind = f"MoE ({args.experts} experts, 2 per token)" if args.experts else "dense"
    print(f"8 fake CPU devices, {kind} CausalTransformer width {args.width}, seq {args.seq}, "
          f"16 rows; median of {args.rounds} interleaved rounds of {args.steps} steps")
    for row in rows:
        print(f"{row['name']:<28} {row['step_ms']:8.1f} ms/step   x{row['step_ms'] / baseline:.2f} "
              "vs data parallelism")


if __name__ == "__main__":
    main()
