"""Ring attention against the all-gather form: per-device attention memory from XLA's memory analysis.

One causal self-attention layer (CausalSelfAttention, packed documents,
rotary positions) is differentiated on 8 fake CPU devices, its positions
split over the mesh's sequence axis (the rest of the devices split the
batch). The compiled program's temporaries (what one step of the layer
allocates beyond its inputs and outputs: the projections, the gathered keys
and values, the scores and the probabilities kept for the backward) are
compared between attention="einsum" (every device gathers every key and
value) and "ring" (keys and values pass around the ring, blockwise, in the
zigzag layout). Step times are printed too, min and median of --steps runs;
all in one run, the ratios are the figures (XLA's CPU compiler fuses
otherwise than an accelerator's).

    .venv/bin/python benchmarks/ring_attention_bench.py [--seq 1024] [--sequences 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from dew.cli.runs import positive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=positive, default=1024)
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--heads", type=positive, default=8)
    parser.add_argument("--width", type=positive, default=64)
    parser.add_argument("--steps", type=positive, default=3)
    parser.add_argument("--sequences", type=positive, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    for sequence in args.sequences:
        if 8 % sequence:
            parser.error(f"--sequences {sequence} does not divide the 8 fake devices; use 1, 2, 4 or 8")
        if args.batch % (8 // sequence):
            parser.error(f"--batch {args.batch} does not split over the {8 // sequence} devices that share "
                         f"the batch at --sequences {sequence}; use a multiple of {8 // sequence}")
        if args.seq % (2 * sequence):
            parser.error(f"--seq {args.seq} does not split into the {2 * sequence} zigzag blocks of "
                         f"--sequences {sequence}; use a multiple of {2 * sequence}")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from dew.nn.layers import CausalSelfAttention
    from dew.training.placement.layout import Layout
    from dew.training.placement.mesh import MeshSpec, build_mesh

    features = args.heads * args.width
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.seq, features)).astype(np.float32)
    positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), (args.batch, args.seq))
    segments = np.sort(rng.integers(1, 5, size=(args.batch, args.seq)), axis=1).astype(np.int32)
    print(f"{len(jax.devices())} fake CPU devices; one attention layer, batch {args.batch} x {args.seq} "
          f"positions, {args.heads} heads of {args.width}; gradient of its output")
    for sequence in args.sequences:
        mesh = build_mesh(MeshSpec(sequence=sequence))
        rules = Layout().axis_rules
        row = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), "sequence"))
        inputs = (jax.device_put(x, row), jax.device_put(positions, row), jax.device_put(segments, row))
        figures = {}
        for kind in ("einsum", "ring"):
            layer = CausalSelfAttention(args.heads, args.width, args.seq, rotary=True, attention=kind)
            variables = layer.init(jax.random.key(0), x[:1, :8], positions[:1, :8])

            def loss(variables: object, x: jax.Array, where: jax.Array, segments: jax.Array,
                     layer: CausalSelfAttention = layer) -> jax.Array:
                return jnp.sum(layer.apply(variables, x, where, segment_ids=segments) ** 2)

            with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
                step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, *inputs).compile()
                times = []
                for _ in range(args.steps):
                    began = time.perf_counter()
                    jax.block_until_ready(step(variables, *inputs))
                    times.append(time.perf_counter() - began)
            figures[kind] = (step.memory_analysis().temp_size_in_bytes, min(times), statistics.median(times))
        (gathered, g_min, g_median), (ring, r_min, r_median) = figures["einsum"], figures["ring"]
        print(f"sequence={sequence}: attention memory per device {gathered / 2**20:8.1f} MiB all-gathered, "
              f"{ring / 2**20:8.1f} MiB ring: {ring / gathered:.2f} x; step min {1e3 * g_min:.0f} / "
              f"{1e3 * r_min:.0f} ms, median {1e3 * g_median:.0f} / {1e3 * r_median:.0f} ms "
              f"({r_median / g_median:.2f} x)")


if __name__ == "__main__":
    main()
