"""Pipeline schedules against GPipe: peak activation memory from XLA's memory analysis, in one run.

Each schedule compiles the Trainer's own step for the same scanned
CausalTransformer, mesh (stage=4 on 8 fake CPU devices, so data=2) and
global batch, and reads the compiled program's memory analysis: the
temporaries (activations and scratch a step allocates beyond its inputs and
outputs) are the activation memory; the peak adds the inputs and the output
not aliased to them. Every figure is printed against GPipe's in the same
interpreter, both without rematerialization and with remat="full" (GPipe's
fair comparison there: 1F1B always recomputes a chunk in its backward).

The step time is printed too, as a sanity figure only: on fake CPU devices
every stage shares the host's cores, so it counts work (1F1B's extra forward
of the stack), not overlap.

    .venv/bin/python benchmarks/pipeline_schedule_bench.py [--steps 3] [--width 256] [--seq 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from dew.cli.runs import positive

SCHEDULES = (
    ("gpipe", {"schedule": "gpipe"}),
    ("1f1b", {"schedule": "1f1b"}),
    ("interleaved 1f1b (2 repeats)", {"schedule": "1f1b", "circular_repeats": 2}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=3)
    parser.add_argument("--width", type=positive, default=256)
    parser.add_argument("--layers", type=positive, default=8)
    parser.add_argument("--seq", type=positive, default=128)
    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--stages", type=positive, default=4)
    parser.add_argument("--microbatches", type=positive, default=8)
    args = parser.parse_args()
    chunks = args.stages * max(arm.get("circular_repeats", 1) for _, arm in SCHEDULES)
    if 8 % args.stages:
        parser.error(f"--stages {args.stages} does not divide the 8 fake devices; use 1, 2, 4 or 8")
    if args.layers % chunks:
        parser.error(f"--layers {args.layers} does not split into the interleaved arm's {chunks} chunks "
                     f"(--stages x 2 repeats); use a multiple of {chunks}")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew import Trainer
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.base import Aux, Mean, Objective
    from dew.training.placement.mesh import MeshSpec, data_partition, shard_batch
    from dew.training.placement.stages import schedule_of

    rows = np.random.default_rng(0).integers(0, 256, size=(args.batch, args.seq + 1)).astype(np.int32)
    print(f"{len(jax.devices())} fake CPU devices; {args.layers} layers of width {args.width}, batch "
          f"{args.batch} x {args.seq} tokens; stage={args.stages}, microbatches={args.microbatches}")
    for remat in ("none", "full"):
        model = CausalTransformer(vocab_size=256, emb_features=args.width, num_layers=args.layers,
                                  num_heads=4, mlp_features=4 * args.width, max_seq_len=args.seq,
                                  remat=remat, scan_layers=True)

        class LM(Objective):
            def init(self, key: jax.Array, variables: object = None, model: CausalTransformer = model) -> object:
                return model.init(key, jnp.zeros((1, args.seq), jnp.int32))

            def loss(self, variables: object, batch: dict, step: object,
                     model: CausalTransformer = model) -> tuple[Mean, Aux]:
                logits = model.apply(variables, batch["text"][:, :-1])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:])
                return Mean(ce.sum(), jnp.asarray(ce.size, jnp.float32)), Aux()

        print(f"\nremat={remat!r}")
        baseline = None
        for name, fields in SCHEDULES:
            spec = MeshSpec(stage=args.stages, microbatches=args.microbatches, **fields)
            trainer = Trainer(LM(), optax.adamw(1e-3), key=jax.random.key(0), mesh=spec)
            state, _, _ = trainer.place()
            mesh = trainer.device_mesh
            batch = shard_batch({"text": rows}, mesh, data_partition(mesh))
            step = trainer.compile(state, batch)
            memory = step.executable.memory_analysis()
            temporaries = memory.temp_size_in_bytes
            peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                    + temporaries)
            times = []
            for _ in range(args.steps + 1):
                began = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - began)
            times = times[1:]
            schedule = schedule_of(spec)
            figures = (f"activations {temporaries / 2**20:7.1f} MiB, peak {peak / 2**20:7.1f} MiB; bubble "
                       f"{schedule.bubble:.3f}, holds {schedule.held} microbatch activations; step min "
                       f"{1e3 * min(times):.0f} ms, median {1e3 * statistics.median(times):.0f} ms")
            if baseline is None:
                baseline = (temporaries, peak, statistics.median(times))
                print(f"  {name:30s} {figures}  (baseline)")
                continue
            print(f"  {name:30s} {figures}\n  {'':30s} activations {temporaries / baseline[0]:.2f} x GPipe's, "
                  f"peak {peak / baseline[1]:.2f} x, step time {statistics.median(times) / baseline[2]:.2f} x")


if __name__ == "__main__":
    main()
