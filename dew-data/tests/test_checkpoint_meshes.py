"""A checkpoint moves between meshes and process counts without adding any error.

The exact claim: a run resumed from a checkpoint on mesh B (or at another
process count) gives, bit for bit, the losses of a run on B that received the
same saved state in memory (``device_get``, then placed with B's shardings)
and read the same data from the same place, with no checkpoint between them.
Both runs use the trainer's own compiled step. Across meshes the losses also
follow the uninterrupted run on the saving mesh within float reassociation.

What has to survive the move for that to hold, and what the objective below
makes visible in its losses: the data position (a Grain ``train_stream``,
whose records carry their index so the test sees which examples each step
read), the root key and the step counter (the loss drops tokens drawn from
the step's key), the optimizer state (Adam's moments and count), the EMA (a
metric is the EMA weights' loss) and a half-filled accumulation window
(accumulation=2, saved after an odd step).
"""

from __future__ import annotations

import json

import pytest

from dew.testing.processes import shared_compilation_cache

COMMON = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from dew import Trainer
from dew.data.sources import ArrayRecords
from dew.data.stream import record_dataset
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Aux, EMASpec, Mean, Objective
from dew.checkpoints.manager import Checkpoints
from dew.testing.doubles import RecordingTracker, WatchedStream
from dew.training.feed import Feed
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec, data_partition

ROWS = 16
TEXTS = np.random.default_rng(0).integers(0, 32, size=(40, 9)).astype(np.int32)
# 40 records, 16 a batch: the stream crosses an epoch (and its reshuffle) inside the run.
RECORDS = record_dataset(ArrayRecords({"text": TEXTS, "id": np.arange(40, dtype=np.int32)}), None,
                         batch=ROWS, seed=3, prefetch=0)


class LM(Objective):
    ema = EMASpec(decay=0.8)

    def __init__(self, layers=2):
        self.model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=layers, num_heads=2,
                                       mlp_features=32, max_seq_len=8, position_embedding="rotary",
                                       mlp_activation="swiglu", scan_layers=True)

    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, 8), jnp.int32))

    def loss(self, variables, batch, step):
        inputs, targets = batch["text"][:, :-1], batch["text"][:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(self.model.apply(variables, inputs), targets)
        # The step's key picks the predicted tokens, so a wrong key or step counter shows in the loss.
        keep = jax.random.bernoulli(step.key, 0.75, ce.shape).astype(jnp.float32)
        averaged = optax.softmax_cross_entropy_with_integer_labels(self.model.apply(step.ema, inputs), targets)
        return (Mean((ce * keep).sum(), keep.sum()),
                Aux(metrics={"ema_loss": Mean(averaged.sum(), jnp.asarray(averaged.size, jnp.float32))}))


SEEN = []  # the record ids of every batch this process read, in order


DATA = Dataset(train=lambda partition: WatchedStream(RECORDS.train(partition),
                                                    lambda batch: SEEN.append(batch["id"].tolist())), batch=ROWS)


def trainer(spec, checkpoints=None, tracker=None):
    return Trainer(LM(), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                   layout=Layout(min_shard=0, tolerance=1.0), accumulation=2, tracker=tracker,
                   checkpoints=None if checkpoints is None else Checkpoints(checkpoints))


def train(spec, steps, checkpoints=None, every=None):
    # (losses, EMA losses, batches read, final state) of a fit to steps.
    log = RecordingTracker()
    SEEN.clear()
    state = trainer(spec, checkpoints, log).fit(DATA, steps=steps, log_every=1, checkpoint_every=every)
    return (log.values("train/loss"), log.values("train/ema_loss"), list(SEEN), state)


def place(tree, shardings):
    # Host arrays onto global shardings (every process passes the same whole arrays).
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(np.shape(a), s, lambda i: np.asarray(a)[i]),
                        tree, shardings)


def host(state):
    # The whole state as numpy on every process (host arrays stay as they are).
    from jax.experimental import multihost_utils
    def one(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        return np.asarray(jax.device_get(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, state)


COMPILED = {}  # spec -> (trainer, shardings, compiled step): one compilation for every continuation


def in_memory(spec, saved, skip, steps):
    # Continue a state held in memory on spec's mesh for steps steps, with no checkpoint: place
    # it with the trainer's shardings, read the stream from its start past skip batches, and
    # run the trainer's compiled step. (losses, EMA losses, batches read, final state).
    name = json.dumps(spec, sort_keys=True)
    if name not in COMPILED:
        run = trainer(spec)  # its shardings, from the shapes of a fresh state (nothing compiled)
        COMPILED[name] = [run, run.shardings(jax.eval_shape(run.initial_state)), None]
    run, shardings, step_fn = COMPILED[name]
    state = place(saved, shardings)
    SEEN.clear()
    feed = Feed(DATA, run.device_mesh, data_partition(run.device_mesh))
    feed.open(None, resuming=False)
    for step in range(skip):
        feed.next(state, step)
    losses, ema = [], []
    for step in range(skip, skip + steps):
        fed = feed.next(state, step)
        step_fn = COMPILED[name][2] = step_fn or run.compile(state, fed.batch)
        state, metrics = step_fn(state, fed.batch)
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
        ema.append(float(np.asarray(metrics["ema_loss"].addressable_data(0))))
    feed.close()
    return losses, ema, list(SEEN[skip:]), state


def same(a, b):
    # Whether two states hold the same tree of bit-identical arrays.
    a, b = host(a), host(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
"""

JOIN = r"""
from dew.training.runtime.process import ProcessSettings, prepare_process
prepare_process(ProcessSettings(multi_host=True))  # the pool run_pool describes, as a launched rank joins it
"""

MESHES = COMMON + r"""
directory = json.loads(sys.argv[1])
A, B = {"fsdp": 8}, {"stage": 2, "fsdp": 4, "microbatches": 4}
full = train(A, 6)
first = train(A, 3, checkpoints=directory, every=3)
saved = host(first[3])
restored = trainer(B, directory).place()[0]  # step 3, before the resumed run saves step 6
resumed = train(B, 6, checkpoints=directory)
reference = in_memory(B, saved, 3, 3)
# Each piece of the state, and the data position, changed alone changes the losses compared.
def differs(state, skip=3):
    losses, ema, _, _ = in_memory(B, state, skip, 2)
    return losses != reference[0][:2] or ema != reference[1][:2]
changed = {
    "key": differs(saved.replace(key=saved.key ^ np.uint32(1))),
    "step": differs(saved.replace(step=saved.step + 1)),
    "opt_state": differs(saved.replace(opt_state=jax.tree.map(
        lambda x: x * 1.5 if x.dtype == np.float32 else x, saved.opt_state))),
    "ema": differs(saved.replace(ema=jax.tree.map(lambda x: x * 0, saved.ema))),
    "window": differs(saved.replace(window=saved.window.replace(count=saved.window.count * 0))),
    "position": differs(saved, skip=2),
}
print("RESULT" + json.dumps({
    "full": full[:3], "first_batches": first[2], "resumed": resumed[:3], "reference": reference[:3],
    "restored_equal": same(restored, saved), "final_equal": same(resumed[3], reference[3]),
    "window_filled": int(saved.window.filled), "step": int(saved.step), "changed": changed}))
"""

# Eight fake devices share this machine's few cores: a device thread can wait long past
# XLA:CPU's 40 s collective deadline for its turn, which is load, not a hang.
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def _result(stdout: str) -> dict:
    return json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])


def cached(directory) -> dict[str, str]:
    """JAX's persistent compilation cache in directory: the runs of one test compile one program
    each for the same mesh (a fit and its in-memory twin), so every one after the first loads it."""
    return {"JAX_COMPILATION_CACHE_DIR": str(shared_compilation_cache(directory)), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def run(python_in_subprocess, program: str, argument, devices: int, cache=None) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices} {PATIENT}"
    stdout = python_in_subprocess(
        f"import sys; sys.argv = ['x', {json.dumps(json.dumps(argument))}]\n" + program,
        devices=devices, env={"XLA_FLAGS": flags, **(cached(cache) if cache else {})}, timeout=1200,
    )
    return _result(stdout)


@pytest.mark.slow
def test_a_checkpoint_moves_from_fsdp_to_pipeline_stages_adding_no_error(python_in_subprocess, tmp_path):
    result = run(python_in_subprocess, MESHES, str(tmp_path), devices=8, cache=tmp_path / "cache")
    print(json.dumps(result))
    full_losses, full_ema, full_batches = result["full"]
    losses, ema, batches = result["resumed"]
    ref_losses, ref_ema, ref_batches = result["reference"]
    assert result["step"] == 3 and result["window_filled"] == 1  # saved mid-window
    # The state restored on stage=2, fsdp=4 is the one fsdp=8 saved, bit for bit ...
    assert result["restored_equal"]
    # ... and the three steps resumed from it are those of the same state handed over in memory.
    assert len(losses) == 3
    assert losses == ref_losses and ema == ref_ema and result["final_equal"]
    # Each resumed step read the global batch the uninterrupted run read at that step.
    assert batches == ref_batches == full_batches[3:]
    assert result["first_batches"] == full_batches[:3]
    # Against the uninterrupted fsdp=8 run: equal within float reassociation (the pipeline sums
    # its microbatches in another order).
    assert losses == pytest.approx(full_losses[3:], abs=1e-5, rel=1e-5)
    assert ema == pytest.approx(full_ema[3:], abs=1e-5, rel=1e-5)
    # The comparison sees every piece of the state and the data position.
    assert result["changed"] == dict.fromkeys(
        ["key", "step", "opt_state", "ema", "window", "position"], True)
    print("fsdp=8 vs stage=2 fsdp=4 after resume, largest loss difference:",
          max(abs(a - b) for a, b in zip(losses, full_losses[3:], strict=True)))


# Another process count. fsdp=8 over one process of 8 devices and over a pool of 2 processes x 4
# devices is the same mesh shape; the shares of each batch move between processes. Each run
# saves its step-3 state (pickled whole) beside its checkpoint, so the other can continue it in
# memory.
SAVE_ALONE = COMMON + r"""
import pickle
directory = json.loads(sys.argv[1])
full = train({"fsdp": 8}, 6)
first = train({"fsdp": 8}, 3, checkpoints=directory + "/alone", every=3)
pickle.dump(host(first[3]), open(directory + "/alone.pkl", "wb"))
print("RESULT" + json.dumps({"full": full[:3], "first": first[:3]}))
"""

IN_POOL = JOIN + COMMON + r"""
import pickle
directory = sys.argv[1]
A = {"fsdp": 8}
share = data_partition(trainer(A).device_mesh).share
first = train(A, 3, checkpoints=directory + "/pool", every=3)
if jax.process_index() == 0:
    pickle.dump(host(first[3]), open(directory + "/pool.pkl", "wb"))
else:
    host(first[3])  # a collective: every process takes part
alone = pickle.load(open(directory + "/alone.pkl", "rb"))
restored = trainer(A, directory + "/alone").place()[0]
resumed = train(A, 6, checkpoints=directory + "/alone")
reference = in_memory(A, alone, 3, 3)
print("RESULT" + json.dumps({"process": jax.process_index(), "share": share, "first": first[:3],
                             "resumed": resumed[:3], "reference": reference[:3],
                             "restored_equal": same(restored, alone),
                             "final_equal": same(resumed[3], reference[3])}), flush=True)
"""

RESUME_ALONE = COMMON + r"""
import pickle
directory = json.loads(sys.argv[1])
pool = pickle.load(open(directory + "/pool.pkl", "rb"))
restored = trainer({"fsdp": 8}, directory + "/pool").place()[0]
resumed = train({"fsdp": 8}, 6, checkpoints=directory + "/pool")
reference = in_memory({"fsdp": 8}, pool, 3, 3)
alone = pickle.load(open(directory + "/alone.pkl", "rb"))
print("RESULT" + json.dumps({"resumed": resumed[:3], "reference": reference[:3],
                             "step3_equal": same(pool, alone),
                             "restored_equal": same(restored, pool),
                             "final_equal": same(resumed[3], reference[3])}))
"""


def _merged(results: list[dict], key: str) -> list:
    """The pool's (losses, EMA losses, global batches) of key: process 0 logs, the shares' rows join."""
    ordered = sorted(results, key=lambda r: r["share"])
    zero = next(r for r in results if r["process"] == 0)
    losses, ema = zero[key][0], zero[key][1]
    batches = [sum(rows, []) for rows in zip(*(r[key][2] for r in ordered), strict=True)]
    return [losses, ema, batches]


@pytest.mark.slow
def test_a_checkpoint_moves_between_one_process_and_a_pool_of_two(python_in_subprocess, tmp_path):
    from dew.testing.processes import run_pool

    cache = tmp_path / "cache"
    alone = run(python_in_subprocess, SAVE_ALONE, str(tmp_path), devices=8, cache=cache)
    pooled = run_pool(IN_POOL, processes=2, devices=4, args=[str(tmp_path)], timeout=900,
                      env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {PATIENT}", **cached(cache)})
    for index, finished in enumerate(pooled):
        assert finished.returncode == 0, f"process {index}: {finished.stderr[-4000:]}"
    results = [_result(finished.stdout) for finished in pooled]
    assert sorted(r["share"] for r in results) == [0, 1]  # each process reads half of every batch
    back = run(python_in_subprocess, RESUME_ALONE, str(tmp_path), devices=8, cache=cache)
    print(json.dumps({"alone": alone, "pool": results, "back": back}))
    full_losses, full_ema, full_batches = alone["full"]
    pool_first = _merged(results, "first")
    pool_resumed = _merged(results, "resumed")
    pool_reference = _merged(results, "reference")

    # One process's checkpoint, read by the pool: the saved state bit for bit on every process,
    # and the losses of that state continued in memory in the pool.
    assert all(r["restored_equal"] and r["final_equal"] for r in results)
    assert pool_resumed == pool_reference
    # The pool's checkpoint, read by one process: likewise.
    assert back["restored_equal"] and back["final_equal"]
    assert back["resumed"] == back["reference"]
    # The data position crosses the process count: the global batches after either resume are
    # the uninterrupted run's, and so were the pool's own first batches.
    assert pool_first[2] == alone["first"][2] == full_batches[:3]
    assert pool_resumed[2] == back["resumed"][2] == full_batches[3:]
    # Against the uninterrupted run of one process.
    for losses, reference in ((pool_first[0], full_losses[:3]), (pool_resumed[0], full_losses[3:]),
                              (back["resumed"][0], full_losses[3:])):
        assert losses == pytest.approx(reference, abs=1e-5, rel=1e-5)
    print("one process vs a pool of two, fsdp=8: step-3 states bitwise equal:", back["step3_equal"],
          "; largest loss difference:",
          max(abs(a - b) for a, b in zip(pool_first[0] + pool_resumed[0], full_losses, strict=True)),
          "; the pool's resumed losses bitwise equal to one process's:", pool_resumed[0] == full_losses[3:])


REFUSED = COMMON + r"""
import os
from dew.nn.pipeline import StageDivisionError
directory = json.loads(sys.argv[1])
def saved(spec, layers=3):
    return Trainer(LM(layers), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                   layout=Layout(min_shard=0, tolerance=1.0), accumulation=2,
                   checkpoints=Checkpoints(directory))
saved({"fsdp": 2}).fit(DATA, steps=1)
def files():
    return sorted((os.path.relpath(os.path.join(d, f), directory), os.path.getsize(os.path.join(d, f)))
                  for d, _, names in os.walk(directory) for f in names if not f.startswith(".dew-writer"))
before = files()
try:
    saved({"stage": 2}).fit(DATA, steps=2)
except StageDivisionError as error:
    print("REFUSED", error)
print("KEPT", files() == before)
print("STEP", int(saved({"fsdp": 2}).place()[0].step))
"""


@pytest.mark.slow
def test_a_restore_onto_stages_that_cannot_split_the_saved_layers_names_the_fix(python_in_subprocess, tmp_path):
    out = python_in_subprocess(
        f"import sys; sys.argv = ['x', {json.dumps(json.dumps(str(tmp_path)))}]\n" + REFUSED, devices=2)
    lines = {line.split(" ", 1)[0]: line for line in out.splitlines()}
    refused = lines["REFUSED"]
    assert "params/layers has 3 layers" in refused and "stage=2" in refused
    assert f"the checkpoint at step 1 in {tmp_path}" in refused
    assert "restore it with stage=1 or stage=3" in refused
    # Nothing written is touched, and the step still restores where it fits.
    assert lines["KEPT"] == "KEPT True" and lines["STEP"] == "STEP 1"
