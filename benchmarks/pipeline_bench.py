"""Pipeline stages against data parallelism alone, on 8 fake CPU devices, in one run.

Each configuration trains the same scanned CausalTransformer on the same
global batch; the step the Trainer compiles is timed steady-state (median of
--steps calls after a warm-up), and every figure is printed against the
data-parallel step measured in the same interpreter.

On fake CPU devices every "device" shares the host's cores, so the step
time measures the work a configuration does rather than how it overlaps.
That makes it a direct reading of the pipeline's waste: GPipe runs
(microbatches + stages - 1) iterations of stages x (one microbatch through
layers/stages layers), against microbatches x stages of useful work, so
the measured bubble 1 - t_data / t_pipeline approaches the schedule's
(stages - 1) / (microbatches + stages - 1) when the step is compute-bound.
A sanity figure on CPU: on real accelerators the stages run concurrently.

    .venv/bin/python benchmarks/pipeline_bench.py [--steps 5] [--width 128] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from dew.cli.runs import positive

CONFIGS = (
    ("data parallel (8)", {}),
    ("stage=2, microbatches=4", {"stage": 2, "microbatches": 4}),
    ("stage=2, microbatches=8", {"stage": 2, "microbatches": 8}),
    ("stage=4, microbatches=8", {"stage": 4, "microbatches": 8}),
    ("stage=2, fsdp=2, microbatches=8", {"stage": 2, "fsdp": 2, "microbatches": 8}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=5)
    parser.add_argument("--width", type=positive, default=128)
    parser.add_argument("--layers", type=positive, default=8)
    parser.add_argument("--seq", type=positive, default=64)
    parser.add_argument("--batch", type=positive, default=64)
    args = parser.parse_args()
    stages = max(spec.get("stage", 1) for _, spec in CONFIGS)
    if args.layers % stages:
        parser.error(f"--layers {args.layers} does not split into the {stages} pipeline stages; give a multiple of "
                     f"{stages}")
    # Each arm splits the batch over the 8 // stage devices of a stage, then into its microbatches.
    splits = max(8 // spec.get("stage", 1) * (spec.get("microbatches") or 1) for _, spec in CONFIGS)
    if args.batch % splits:
        parser.error(f"--batch {args.batch} does not split over every arm's devices and microbatches; give a "
                     f"multiple of {splits}")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew import Trainer
    from dew.nn.backbones import CausalTransformer
    from dew.nn.pipeline import PipelineSchedule
    from dew.objectives.base import Aux, Mean, Objective
    from dew.training.placement.mesh import MeshSpec, data_partition, shard_batch

    model = CausalTransformer(vocab_size=256, emb_features=args.width, num_layers=args.layers,
                              num_heads=4, mlp_features=4 * args.width, max_seq_len=args.seq,
                              scan_layers=True)

    class LM(Objective):
        def init(self, key: jax.Array, variables: object = None) -> object:
            return model.init(key, jnp.zeros((1, args.seq), jnp.int32))

        def loss(self, variables: object, batch: dict, step: object) -> tuple[Mean, Aux]:
            logits = model.apply(variables, batch["text"][:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:])
            return Mean(ce.sum(), jnp.asarray(ce.size, jnp.float32)), Aux()

    rows = np.random.default_rng(0).integers(0, 256, size=(args.batch, args.seq + 1)).astype(np.int32)
    print(f"{len(jax.devices())} fake CPU devices; {args.layers} layers of width {args.width}, "
          f"batch {args.batch} x {args.seq} tokens; median of {args.steps} steps")
    baseline = None
    for name, spec in CONFIGS:
        mesh_spec = MeshSpec(**spec)
        trainer = Trainer(LM(), optax.adamw(1e-3), key=jax.random.key(0), mesh=mesh_spec)
        state, _, _ = trainer.place()
        mesh = trainer.device_mesh
        batch = shard_batch({"text": rows}, mesh, data_partition(mesh))
        step = trainer.compile(state, batch)
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            began = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - began)
        seconds = statistics.median(times)
        if baseline is None:
            baseline = seconds
            print(f"{name:34s} {1e3 * seconds:8.1f} ms/step  (baseline)")
            continue
        schedule = PipelineSchedule(mesh_spec.stage, mesh_spec.microbatches)
        reported = float(metrics["pipeline_bubble"])
        measured = 1 - baseline / seconds
        print(f"{name:34s} {1e3 * seconds:8.1f} ms/step  ratio {seconds / baseline:5.2f} x data "
              f"parallel; bubble reported {reported:.3f}, bound (S-1)/(M+S-1) "
              f"{schedule.bubble:.3f}, measured 1 - t_dp/t {measured:.3f}")


if __name__ == "__main__":
    main()
