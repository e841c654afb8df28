"""How long a checkpoint stops the training loop, against a synchronous Orbax save of the same state.

Run: .venv/bin/python benchmarks/checkpoint_bench.py [--megabytes 150] [--repeats 3]

Prints, in one run:
  * blocked: the wall time of Checkpoints.save() (the device->host copy and
    the dispatch of the leaf digests), and the extra time a loop of steps
    with one save in it takes over the same loop without it;
  * sync: ocp.CheckpointManager.save of the same state with async off;
  * restore: Checkpoints.restore (with its file and digest checks) and a
    plain Orbax restore of the same step;
  * the ratio blocked / sync (the target is at most 0.20).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dew.data.base import DataPartition
from dew.training.checkpoints import Checkpoints
from dew.training.state import TrainState


def build_state(megabytes: float) -> TrainState:
    """params, and an Adam-like mu and nu of the same size: megabytes in all (float32)."""
    per_tree = megabytes * 2**20 / 4 / 3
    rows = 1024
    count = 6
    cols = max(1, int(per_tree / count / rows))
    key = jax.random.key(0)
    params = {"params": {f"layer{i}": jax.random.normal(jax.random.fold_in(key, i), (rows, cols))
                         for i in range(count)}}
    zeros = jax.tree.map(jnp.zeros_like, params)
    def counter() -> jax.Array:
        return jnp.asarray(0, jnp.int32)

    return TrainState(params=params, opt_state=(zeros, jax.tree.map(jnp.ones_like, params)),
                      key=jax.random.key_data(key), step=counter(), microstep=counter(), updates=counter())


@jax.jit
def _update(state: TrainState) -> TrainState:
    return state.replace(
        params=jax.tree.map(lambda p: p * 0.999 + 0.001, state.params),
        opt_state=jax.tree.map(lambda m: m * 0.9 + 0.1, state.opt_state),
        step=state.step + 1,
    )


step_fn = jax.jit(_update, donate_argnums=0)


def loop(state: TrainState, steps: int, save_at: int | None, checkpoints: Checkpoints | None,
         first: int) -> tuple[TrainState, float, float]:
    """Run steps donated updates; optionally one save; return (state, loop seconds, save() seconds)."""
    jax.block_until_ready(state)
    began = time.perf_counter()
    blocked = 0.0
    for index in range(steps):
        state = step_fn(state)
        if save_at == index and checkpoints is not None:
            tic = time.perf_counter()
            checkpoints.save(first + index, state, position=b"0", partition=DataPartition(), meta={})
            blocked = time.perf_counter() - tic
    jax.block_until_ready(state)
    return state, time.perf_counter() - began, blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=150.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    state = build_state(args.megabytes)
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20
    print(f"state: {size:.1f} MiB in {len(jax.tree.leaves(state))} leaves on {jax.devices()[0].platform}")
    with tempfile.TemporaryDirectory(prefix="dew-checkpoint-bench-") as root:
        checkpoints = Checkpoints(Path(root) / "dew", keep=2)
        # Warm up: compile the step and the digests, create the directories.
        state, _, _ = loop(state, 2, 0, checkpoints, 1000)
        checkpoints.wait()

        calls, overheads, bare_loops, writes = [], [], [], []
        for repeat in range(args.repeats):
            state, bare, _ = loop(state, args.steps, None, None, 0)
            state, with_save, call = loop(state, args.steps, args.steps // 2, checkpoints, 10 * (repeat + 1))
            tic = time.perf_counter()
            checkpoints.wait()
            writes.append(time.perf_counter() - tic)
            calls.append(call)
            bare_loops.append(bare)
            overheads.append(max(0.0, with_save - bare))

        manager = ocp.CheckpointManager(
            Path(root) / "orbax-sync",
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, max_to_keep=2, create=True),
        )
        syncs = []
        for repeat in range(args.repeats):
            jax.block_until_ready(state)
            tic = time.perf_counter()
            manager.save(repeat, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
            syncs.append(time.perf_counter() - tic)

        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        dew_restores, orbax_restores = [], []
        for _ in range(args.repeats):
            tic = time.perf_counter()
            restored = checkpoints.restore(template, partition=DataPartition())
            jax.block_until_ready(restored.state)
            dew_restores.append(time.perf_counter() - tic)
            tic = time.perf_counter()
            plain = manager.restore(manager.latest_step(),
                                    args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
            jax.block_until_ready(plain.state)
            orbax_restores.append(time.perf_counter() - tic)
        checkpoints.close()
        manager.close()

    med = statistics.median
    call, overhead, sync = med(calls), med(overheads), med(syncs)
    print(f"loop of {args.steps} steps without a save: {med(bare_loops) * 1e3:8.1f} ms")
    print(f"Checkpoints.save() call (blocked):        {call * 1e3:8.1f} ms")
    print(f"loop slowdown from one save:              {overhead * 1e3:8.1f} ms")
    print(f"background write, waited after the loop:  {med(writes) * 1e3:8.1f} ms")
    print(f"synchronous Orbax save:                   {sync * 1e3:8.1f} ms")
    print(f"Checkpoints.restore (verified):           {med(dew_restores) * 1e3:8.1f} ms")
    print(f"plain Orbax restore:                      {med(orbax_restores) * 1e3:8.1f} ms")
    print(f"blocked / sync: save() call {call / sync:.3f}, loop slowdown {overhead / sync:.3f} (target <= 0.20)")


if __name__ == "__main__":
    main()
