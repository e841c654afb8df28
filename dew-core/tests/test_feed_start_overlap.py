"""A fit starts its data stream before it places the state: the first batch is read while the
initializer compiles and runs (or the checkpoint is restored), the loop waits only for what is
left, and the stream is closed whichever way the start-up ends (a SIGTERM while placing, with
Grain's worker processes: dew-data/tests/test_feed_start_sigterm.py)."""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.telemetry.records import Goodput
from dew.testing.doubles import Linear, RecordingTracker
from dew.testing.processes import run_python
from dew.training.program import ResumeMismatchError


def batch_at(index: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(index).normal(size=(8, 4)).astype(np.float32)
    return {"x": x, "y": x @ np.arange(1, 5, dtype=np.float32)[:, None] + 1}


def assert_same_params(state, expected) -> None:
    leaves, want = jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(expected.params))
    assert len(leaves) == len(want) > 0
    for leaf, other in zip(leaves, want, strict=True):
        np.testing.assert_array_equal(leaf, other)


class Watched:
    """A resumable stream of batch_at(0), batch_at(1), ... that reports its first read and closing.

    Its first next() sets ``reading``, then waits for ``release`` (when given)
    before it returns; ``read_seconds`` is how long that first next() took.
    """

    def __init__(self, log: list, release: threading.Event | None = None) -> None:
        self.index, self.log, self.release = 0, log, release
        self.reading = threading.Event()
        self.read_seconds = 0.0

    def __iter__(self) -> Watched:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if not self.reading.is_set():
            began = time.perf_counter()
            self.log.append(("read", self.index))
            self.reading.set()
            if self.release is not None:
                assert self.release.wait(60), "placement never ended"
            self.read_seconds = time.perf_counter() - began
        self.index += 1
        return batch_at(self.index - 1)

    def get_state(self) -> bytes:
        return str(self.index).encode()

    def set_state(self, state: bytes) -> None:
        self.log.append(("set_state", state))
        self.index = int(state)

    def close(self) -> None:
        self.log.append(("closed", self.index))


def watched(log: list, streams: list, release: threading.Event | None = None) -> Dataset:
    def train(partition):
        log.append(("train", None))
        streams.append(Watched(log, release))
        return streams[-1]

    return Dataset(train=train, val=None, batch=8)


def placing(trainer: Trainer, streams: list, log: list, *, after: threading.Event | None = None,
            fail: BaseException | None = None) -> None:
    """Wrap trainer.place: it notes whether the stream's first read had begun before the state was
    placed (waiting a while for it), then places (or fails), then sets after."""
    original = trainer.place

    def place():
        began = bool(streams) and streams[-1].reading.wait(30)
        log.append(("placing", began))
        if fail is not None:
            raise fail
        time.sleep(0.5)  # a placement slower than the first read's start
        result = original()
        log.append(("placed", None))
        if after is not None:
            after.set()
        return result

    trainer.place = place  # type: ignore[method-assign]


def test_the_first_batch_is_read_while_the_state_is_placed_and_only_the_rest_is_waited_for():
    log: list = []
    streams: list = []
    placed = threading.Event()
    tracker = RecordingTracker()
    trainer = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), tracker=tracker)
    placing(trainer, streams, log, after=placed)
    state = trainer.fit(watched(log, streams, release=placed), steps=3, log_every=1)
    # The stream was opened and its first read began before the state was placed.
    assert log[:3] == [("train", None), ("read", 0), ("placing", True)]
    assert ("placed", None) in log and log[-1] == ("closed", 3)
    # The first read lasted the whole placement; the loop waited only for what was left of it.
    goodput = next(value for _, value in tracker.artifacts if isinstance(value, Goodput))
    assert streams[0].read_seconds > 0.5
    assert goodput.data_seconds < 0.5 * streams[0].read_seconds
    # The same three batches as a fit that opens its stream after placing.
    later = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0))
    later._overlap_start = False
    expected = later.fit(Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=3, log_every=1)
    assert_same_params(state, expected)


def test_a_resume_starts_its_stream_at_the_checkpoints_position_before_placing(tmp_path):
    first = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    first.fit(Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=3, log_every=1)
    log: list = []
    streams: list = []
    resumed = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    placing(resumed, streams, log)
    state = resumed.fit(watched(log, streams), steps=5, log_every=1)
    assert log[:4] == [("train", None), ("set_state", b"3"), ("read", 3), ("placing", True)]
    assert [entry for entry in log if entry[0] == "train"] == [("train", None)]  # opened once, not again
    assert log[-1] == ("closed", 5)
    whole = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0))
    expected = whole.fit(Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=5, log_every=1)
    assert_same_params(state, expected)


def test_a_fit_at_its_target_step_opens_no_stream(tmp_path):
    Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path)).fit(
        Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=2, log_every=1)
    for steps in (2, 1):  # at the target, and past it
        log: list = []
        again = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
        state = again.fit(watched(log, []), steps=steps, log_every=1)
        assert int(state.step) == 2
        assert log == []  # Dataset.train was never called


def test_a_failed_placement_closes_the_stream_that_started(tmp_path):
    Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path)).fit(
        Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=2, log_every=1)
    log: list = []
    streams: list = []
    other = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path),
                    accumulation=2)
    original = other.place

    def place():
        log.append(("placing", streams[-1].reading.wait(30)))
        return original()

    other.place = place  # type: ignore[method-assign]
    with pytest.raises(ResumeMismatchError, match="accumulation"):
        other.fit(watched(log, streams), steps=4, log_every=1)
    assert log == [("train", None), ("set_state", b"2"), ("read", 2), ("placing", True), ("closed", 3)]
    # An error raised by place() itself (not the checkpoint's) closes it too.
    log.clear()
    fresh = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0))
    placing(fresh, streams, log, fail=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        fresh.fit(watched(log, streams), steps=4, log_every=1)
    assert log == [("train", None), ("read", 0), ("placing", True), ("closed", 1)]


def test_a_resume_that_falls_back_to_an_older_step_reopens_its_stream_there(tmp_path, capsys):
    first = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path, keep=None))
    first.fit(Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=4, log_every=1, checkpoint_every=2)
    files = [p for p in (tmp_path / "4" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    damaged = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the manifest still reads, the arrays do not: place() falls back to step 2
    damaged.write_bytes(bytes(data))
    log: list = []
    streams: list = []
    resumed = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    placing(resumed, streams, log)
    state = resumed.fit(watched(log, streams), steps=6, log_every=1)
    assert "Restoring step 2 instead" in capsys.readouterr().err
    # Started at step 4's position, closed once step 2 was restored, opened again there.
    assert log[:5] == [("train", None), ("set_state", b"4"), ("read", 4), ("placing", True), ("placed", None)]
    assert log[5:8] == [("closed", 5), ("train", None), ("set_state", b"2")]
    assert log[-1] == ("closed", 6)
    whole = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0))
    expected = whole.fit(Dataset(train=lambda p: Watched([]), val=None, batch=8), steps=6, log_every=1)
    assert_same_params(state, expected)


BUILT_AHEAD = r"""
import json, threading
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.testing.doubles import Linear
from dew.training.execution import DeviceExecution
from dew.training.opening import builds_ahead

class Watched(Linear):
    threads = []  # where the state was built (the initializer compiled and ran)
    traces = 0
    def init(self, key, variables=None):
        Watched.traces += 1
        return super().init(key, variables)

initialize = DeviceExecution.initialize
def watched_initialize(self, *args):
    Watched.threads.append(threading.current_thread().name)
    return initialize(self, *args)
DeviceExecution.initialize = watched_initialize

def batches(partition):
    index = 0
    while True:
        x = np.random.default_rng(index).normal(size=(8, 4)).astype(np.float32)
        yield {"x": x, "y": x @ np.arange(1, 5, dtype=np.float32)[:, None] + 1}
        index += 1

def fit(overlap):
    trainer = Trainer(Watched(), optax.adam(0.1), key=jax.random.key(3))
    trainer._overlap_start = overlap
    Watched.threads.clear()
    Watched.traces = 0
    state = trainer.fit(Dataset(train=batches, batch=8), steps=4, log_every=4)
    return jax.device_get(state.params), list(Watched.threads) + [f"traced {Watched.traces}"], trainer

ahead, threads_ahead, trainer = fit(True)
plain, threads_plain, _ = fit(False)
same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(plain), strict=True))
# A model that swaps jax functions while it runs (qwix's LoRA): its state is never built beside its compile.
from dew.adapters.lora import Lora, apply_lora
from dew.models import build
class Holding:
    def __init__(self, model):
        self.model = model
plain_model = build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
                    mlp_features=32, max_seq_len=8)
intercepting = [builds_ahead(trainer.execution, None, Holding(apply_lora(plain_model, Lora(rank=2)))),
                builds_ahead(trainer.execution, None, Holding(plain_model))]
jax.config.update("jax_compilation_cache_max_size", 2**30)  # an evicting cache: not on a thread
print(json.dumps({"same": same, "ahead": threads_ahead, "plain": threads_plain, "intercepting": intercepting,
                  "evicting": builds_ahead(trainer.execution, None)}))
"""


def test_a_fresh_state_is_built_on_a_thread_while_the_step_compiles_equals_the_plain_start_and_traces_init_once(tmp_path):
    # Its own cache folder, as the suite's: no eviction, so the overlap is on.
    done = run_python(BUILT_AHEAD, env={"JAX_COMPILATION_CACHE_MAX_SIZE": "-1"}, compilation_cache=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"], result
    # Built on the thread (or not), and init traced once either way: the shapes' trace is reused.
    assert result["ahead"] == ["dew-initial-state", "traced 1"], result
    assert result["plain"] == ["MainThread", "traced 1"], result
    assert result["evicting"] is False
    # qwix's wrappers swap jax functions process-wide: the build beside their compile met a KeyError
    # inside qwix (a QLoRA test failed so, once); their state is built on the main thread.
    assert result["intercepting"] == [False, True]


FAILS_WHILE_BUILDING = r"""
import json, threading, time
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.testing.doubles import Linear

class Planted(RuntimeError):
    pass

class SlowInitBadStep(Linear):
    def init(self, key, variables=None):
        if threading.current_thread().name == "dew-initial-state":
            time.sleep(2)  # still building when the step fails to compile
        return super().init(key, variables)
    def loss(self, variables, batch, step):
        raise Planted("the step does not compile")

def batches(partition):
    while True:
        yield {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 1), np.float32)}

try:
    Trainer(SlowInitBadStep(), optax.sgd(0.1), key=jax.random.key(0)).fit(Dataset(train=batches, batch=8), steps=2)
except Planted as error:
    raised = str(error)
print(json.dumps({"raised": raised, "building": [t.name for t in threading.enumerate() if t.name == "dew-initial-state"]}))
"""


def test_a_fit_that_fails_while_its_state_is_built_waits_for_the_build_and_exits_cleanly(tmp_path):
    # An interpreter that ended while XLA compiled the initializer on its thread crashed (SIGSEGV).
    done = run_python(FAILS_WHILE_BUILDING, env={"JAX_COMPILATION_CACHE_MAX_SIZE": "-1"}, compilation_cache=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"raised": "the step does not compile", "building": []}
