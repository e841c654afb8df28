"""How long a checkpoint stops the training loop, against a synchronous Orbax save of the same state.

Run: .venv/bin/python benchmarks/checkpoint_bench.py [--megabytes 150] [--repeats 3]

Each saver runs inside the same loop of donated update steps, saving once
in the middle, so every call also waits for the steps still in flight (as a
real loop does). Printed, in one run:

  * blocked: how long the save call held the loop (dew's Checkpoints.save,
    Orbax's own async save as the floor, and a synchronous Orbax save), once
    with the state ready and once with the loop's steps still in flight (the
    call then also waits for them);
  * slowdown: the extra wall time of the loop with the save over without;
  * restore: Checkpoints.restore (its manifest, file and digest checks
    included) and a plain Orbax restore of the same state, alternated, each
    first in turn, median of --restores, and their ratio (target <= 1.5);
  * the ratio of dew's blocked time to the synchronous save's (target <= 0.20).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dew.checkpoints.manager import Checkpoints
from dew.cli.runs import amount, positive
from dew.data.base import DataPartition
from dew.training.state import TrainState


def build_state(megabytes: float) -> TrainState:
    """params, and an Adam-like mu and nu of the same size: megabytes in all (float32)."""
    rows, count = 1024, 6
    cols = max(1, int(megabytes * 2**20 / 4 / 3 / count / rows))
    key = jax.random.key(0)
    params = {"params": {f"layer{i}": jax.random.normal(jax.random.fold_in(key, i), (rows, cols))
                         for i in range(count)}}

    def counter() -> jax.Array:
        return jnp.asarray(0, jnp.int32)

    return TrainState(params=params, opt_state=(jax.tree.map(jnp.zeros_like, params),
                                                jax.tree.map(jnp.ones_like, params)),
                      key=jax.random.key_data(key), step=counter(), microstep=counter(), updates=counter())


def _update(state: TrainState) -> TrainState:
    return state.replace(
        params=jax.tree.map(lambda p: p * 0.999 + 0.001, state.params),
        opt_state=jax.tree.map(lambda m: m * 0.9 + 0.1, state.opt_state),
        step=state.step + 1,
    )


step_fn = jax.jit(_update, donate_argnums=0)
Saver = Callable[[int, TrainState], None]


def loop(state: TrainState, steps: int, saver: Saver | None, step: int,
         ready: bool = False) -> tuple[TrainState, float, float]:
    """steps donated updates with one save in the middle: (state, loop seconds, save-call seconds).

    ready waits for the steps in flight before the save, so the call's time is the save's alone.
    """
    jax.block_until_ready(state)
    began = time.perf_counter()
    blocked = 0.0
    for index in range(steps):
        state = step_fn(state)
        if saver is not None and index == steps // 2:
            if ready:
                jax.block_until_ready(state)
            tic = time.perf_counter()
            saver(step, state)
            blocked = time.perf_counter() - tic
    jax.block_until_ready(state)
    return state, time.perf_counter() - began, blocked


def measure(state: TrainState, saver: Saver, finish: Callable[[], None], steps: int,
            repeats: int) -> tuple[TrainState, float, float, float]:
    """Median (blocked with the state ready, blocked in flight, slowdown) over repeats, after a warm-up."""
    state, _, _ = loop(state, 2, saver, 1)
    finish()
    alone, blocked, slowdown = [], [], []
    for repeat in range(repeats):
        state, _, call = loop(state, steps, saver, 2 * repeat + 2, ready=True)
        finish()
        alone.append(call)
        state, bare, _ = loop(state, steps, None, 0)
        state, with_save, call = loop(state, steps, saver, 2 * repeat + 3)
        finish()
        blocked.append(call)
        slowdown.append(max(0.0, with_save - bare))
    median = statistics.median
    return state, median(alone), median(blocked), median(slowdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=amount, default=150.0)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--steps", type=positive, default=8)
    parser.add_argument("--restores", type=positive, default=9, help="restores of each kind (median)")
    args = parser.parse_args()

    state = build_state(args.megabytes)
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20
    print(f"state: {size:.1f} MiB in {len(jax.tree.leaves(state))} leaves on {jax.devices()[0].platform}, "
          f"{args.steps}-step loop, median of {args.repeats}")
    partition = DataPartition()
    with tempfile.TemporaryDirectory(prefix="dew-checkpoint-bench-") as root:
        checkpoints = Checkpoints(Path(root) / "dew", keep=2)

        def dew_save(step: int, state: TrainState) -> None:
            checkpoints.save(step, state, position=b"0", partition=partition, meta={})

        state, *dew = measure(state, dew_save, checkpoints.wait, args.steps, args.repeats)

        def manager(name: str, asynchronous: bool) -> ocp.CheckpointManager:
            options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous, max_to_keep=2,
                                                   create=True)
            return ocp.CheckpointManager(Path(root) / name, options=options)

        async_manager, sync_manager = manager("orbax-async", True), manager("orbax-sync", False)
        results = {}
        for name, chosen in (("async", async_manager), ("sync", sync_manager)):
            def orbax_save(step: int, state: TrainState, chosen: ocp.CheckpointManager = chosen) -> None:
                chosen.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)

            state, *results[name] = measure(state, orbax_save, chosen.wait_until_finished, args.steps,
                                            args.repeats)

        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        plain_step = sync_manager.latest_step()

        def dew_restore() -> None:
            jax.block_until_ready(checkpoints.restore(template, partition=partition).state)

        def orbax_restore() -> None:
            plain = sync_manager.restore(plain_step,
                                         args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
            jax.block_until_ready(plain.state)

        dew_restores, orbax_restores = [], []
        for index in range(args.restores):  # alternated, each first in turn, so load and caches fall evenly
            pair = [(dew_restore, dew_restores), (orbax_restore, orbax_restores)]
            for restore, times in pair if index % 2 == 0 else pair[::-1]:
                tic = time.perf_counter()
                restore()
                times.append(time.perf_counter() - tic)
        checkpoints.close()
        async_manager.close()
        sync_manager.close()

    med = statistics.median
    rows = [("dew Checkpoints.save", *dew), ("Orbax async save", *results["async"]),
            ("Orbax synchronous save", *results["sync"])]
    print(f"{'':26}{'blocked ms':>12}{'in flight ms':>14}{'slowdown ms':>13}")
    for name, alone, blocked, slowdown in rows:
        print(f"{name:26}{alone * 1e3:12.1f}{blocked * 1e3:14.1f}{slowdown * 1e3:13.1f}")
    verified, plain = med(dew_restores), med(orbax_restores)
    print(f"restore: dew {verified * 1e3:.1f} ms (verified), plain Orbax {plain * 1e3:.1f} ms, "
          f"ratio {verified / plain:.2f} (target <= 1.5)")
    sync = results["sync"]
    print(f"dew blocked / synchronous save: {dew[0] / sync[0]:.3f} with the state ready, "
          f"{dew[1] / sync[1]:.3f} with steps in flight (target <= 0.20)")


if __name__ == "__main__":
    main()
