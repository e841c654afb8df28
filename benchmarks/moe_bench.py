"""Dropless experts against capacity-factor routing: compiled FLOPs and step time, in one run.

The same RoutedExperts block (8 experts, 2 per token, SwiGLU) is compiled for a
training step (value and gradient of a loss of its output) three ways:

- capacity 1.25: ``routing="capacity"``, the padded einsum form (each expert
  takes 1.25 times its even share of a row's tokens; its dispatch and combine
  are einsums over every token, expert and slot);
- dropless, expert tiles: ``routing="dropless"`` with ``grouped_matmul="tiles"``,
  what runs on the CPU (each expert's rows in whole tiles);
- dropless, ragged_dot: ``grouped_matmul="ragged_dot"``, what runs on GPUs and
  TPUs. XLA:CPU has no ragged dot, and JAX lowers it here to a dense product
  masked per expert (every row times every expert), so on the CPU this arm
  counts experts times the work; it is printed for completeness, not as the
  accelerator's figure.

FLOPs are the compiled programs' own ``cost_analysis()``; times are the
median and minimum of --rounds calls after a warm-up. Every figure is printed
against capacity 1.25 measured in the same interpreter (goal: dropless at
most 0.85 of its FLOPs).

    .venv/bin/python benchmarks/moe_bench.py [--rounds 5] [--batch 8] [--seq 256] [--width 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dew.cli.runs import positive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--seq", type=positive, default=256)
    parser.add_argument("--width", type=positive, default=256)
    parser.add_argument("--hidden", type=positive, default=512)
    parser.add_argument("--experts", type=positive, default=8)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    from dew.nn.experts import RoutedExperts
    from dew.nn.moe import moe_statistics

    block = RoutedExperts(experts=args.experts, hidden_features=args.hidden, experts_per_token=2)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(args.batch, args.seq, args.width)), jnp.float32)
    shapes = nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(0), x))
    rng = np.random.default_rng(1)
    variables = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.05, jnp.float32), shapes)

    arms = {"capacity 1.25": block.clone(routing="capacity", capacity_factor=1.25),
            "dropless, expert tiles": block.clone(grouped_matmul="tiles"),
            "dropless, ragged_dot (CPU: dense)": block.clone(grouped_matmul="ragged_dot")}
    results = {}
    for name, arm in arms.items():
        def loss(variables, x, arm=arm):
            y, sown = arm.apply(variables, x, mutable=["moe"])
            return jnp.mean(jnp.square(y)) + 0.01 * moe_statistics(sown)["load_balancing_loss"]

        compiled = jax.jit(jax.value_and_grad(loss)).lower(variables, x).compile()
        flops = float(compiled.cost_analysis()["flops"])
        jax.block_until_ready(compiled(variables, x))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(compiled(variables, x))
            times.append(time.perf_counter() - start)
        results[name] = (flops, statistics.median(times), min(times))

    tokens = args.batch * args.seq
    # Forward 3 matmuls, their 3 weight gradients, and the hidden's gradient through wo (x is an
    # input, not differentiated): 7 matmuls of 2 * D * M FLOPs for each of a token's 2 experts.
    useful = 7 * 2 * tokens * 2 * args.width * args.hidden
    base_flops, base_median, base_min = results["capacity 1.25"]
    print(f"RoutedExperts: {args.experts} experts, 2 per token, {tokens} tokens of width {args.width}, "
          f"expert width {args.hidden}; training step (value and gradient)")
    print(f"the experts' matmuls alone, counted by hand (no padding, no router): {useful / 1e9:.3f} GFLOP")
    print(f"{'arm':36s} {'GFLOP':>9s} {'x capacity':>11s} {'median s':>9s} {'min s':>8s} "
          f"{'x median':>9s} {'x min':>7s}")
    for name, (flops, median, fastest) in results.items():
        print(f"{name:36s} {flops / 1e9:9.3f} {flops / base_flops:11.3f} {median:9.4f} {fastest:8.4f} "
              f"{median / base_median:9.3f} {fastest / base_min:7.3f}")
    ratio = results["dropless, expert tiles"][0] / base_flops
    print(f"dropless (expert tiles) FLOPs / capacity 1.25 FLOPs = {ratio:.3f} "
          f"({'meets' if ratio <= 0.85 else 'misses'} the goal of <= 0.85)")


if __name__ == "__main__":
    main()
