"""train_stream: resume at every position, one global order at any share count, workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dew.data.base import GLOBAL_POSITION, DataPartition, is_global_position
from dew.data.errors import (
    BatchDivisionError,
    EmptyDatasetError,
    ForeignPositionError,
    MissingKeyError,
    PositionMismatchError,
)
from dew.data.order import epoch_order, permute
from dew.data.sources import ArrayRecords
from dew.data.stream import train_stream, val_stream
from dew.testing.processes import free_port

N = 23  # not a multiple of any batch below: batches cross epoch boundaries


def records(n: int = N) -> ArrayRecords:
    return ArrayRecords({"id": np.arange(n, dtype=np.int64), "x": np.arange(n * 3).reshape(n, 3)})


def take(stream, steps: int) -> list[np.ndarray]:
    return [next(stream)["id"].copy() for _ in range(steps)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    ids = np.concatenate(take(train_stream(records(), batch=N, seed=3), 4))
    epochs = ids.reshape(4, N)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(N))
    assert not all((epochs[0] == e).all() for e in epochs[1:])
    other_seed = np.concatenate(take(train_stream(records(), batch=N, seed=4), 1))
    assert not (other_seed == epochs[0]).all()


@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 1000, 4097])
def test_the_epoch_shuffle_is_a_bijection_computed_per_index(n):
    orders = [epoch_order(n, seed, epoch) for seed in (0, 1) for epoch in (0, 1)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    if n > 16:
        assert len({tuple(o) for o in orders}) == 4
    picked = np.asarray([n - 1, 0, n // 2], np.uint64)
    np.testing.assert_array_equal(permute(picked, n, 1, 1), orders[3][picked.astype(np.int64)])


def test_large_datasets_compute_the_same_order_without_tables(monkeypatch):
    from dew.data import order as module

    tabled = take(train_stream(records(), batch=5, seed=2), 12)
    monkeypatch.setattr(module, "_TABLE_LIMIT", 4)  # every dataset counts as large
    computed = take(train_stream(records(), batch=5, seed=2), 12)
    for a, b in zip(tabled, computed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_rows_carry_every_column_of_their_record():
    batch = next(train_stream(records(), batch=4, seed=0))
    np.testing.assert_array_equal(batch["x"], np.stack([np.arange(3) + 3 * i for i in batch["id"]]))
    assert batch["id"].shape == (4,) and batch["x"].shape == (4, 3)


def test_restoring_at_every_position_gives_the_remaining_stream():
    steps = 14  # > two epochs at batch 4
    reference = take(train_stream(records(), batch=4, seed=7), steps)
    stream = train_stream(records(), batch=4, seed=7)
    positions = []
    for _ in range(steps):
        positions.append(stream.get_state())
        next(stream)
    for k, position in enumerate(positions):
        assert is_global_position(position)
        assert json.loads(position[len(GLOBAL_POSITION):])["records"] == 4 * k
        resumed = train_stream(records(), batch=4, seed=7)
        resumed.set_state(position)
        rest = take(resumed, steps - k)
        for got, want in zip(rest, reference[k:], strict=True):
            np.testing.assert_array_equal(got, want)


def test_two_shares_merge_into_the_one_share_order_and_resume_at_one_share():
    one = take(train_stream(records(), batch=6, seed=1), 8)
    shares = [train_stream(records(), batch=6, seed=1, partition=DataPartition(s, 2)) for s in range(2)]
    halves = [take(stream, 5) for stream in shares]
    for g in range(5):
        np.testing.assert_array_equal(np.concatenate([halves[0][g], halves[1][g]]), one[g])
    # A position saved by share 1 of 2 resumes a single-share stream.
    single = train_stream(records(), batch=6, seed=1)
    single.set_state(shares[1].get_state())
    for got, want in zip(take(single, 3), one[5:8], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_position_resumes_at_another_batch_size():
    reference = np.concatenate(take(train_stream(records(), batch=4, seed=2), 6))
    stream = train_stream(records(), batch=4, seed=2)
    take(stream, 2)
    wider = train_stream(records(), batch=8, seed=2)
    wider.set_state(stream.get_state())
    np.testing.assert_array_equal(np.concatenate(take(wider, 2)), reference[8:24])


def test_val_stream_is_one_ordered_pass_split_among_shares():
    full = list(val_stream(records(), batch=4))
    assert [b["id"].tolist() for b in full] == [list(range(g * 4, g * 4 + 4)) for g in range(5)]
    short = list(val_stream(records(), batch=4, remainder="short"))
    assert np.concatenate([b["id"] for b in short]).tolist() == list(range(23))
    assert len(short[-1]["id"]) == 3
    parts = [list(val_stream(records(), batch=4, partition=DataPartition(s, 2), remainder="short"))
             for s in range(2)]
    assert len(parts[0]) == len(parts[1]) == 6
    merged = [np.concatenate([a["id"], b["id"]]) for a, b in zip(*parts, strict=True)]
    assert np.concatenate(merged).tolist() == list(range(22))  # 3 left over -> 2: one dropped


def test_bad_input_errors_name_the_sizes_and_keys():
    with pytest.raises(BatchDivisionError, match=r"6 rows does not divide among 4"):
        train_stream(records(), batch=6, partition=DataPartition(0, 4))
    with pytest.raises(EmptyDatasetError, match="no records"):
        train_stream(records(0), batch=2)
    with pytest.raises(EmptyDatasetError, match=r"holds 23 records, fewer than one global batch of 32"):
        val_stream(records(), batch=32)
    # A training batch larger than the records repeated some in each batch; 1e12 asked Grain for
    # 7 TiB of indices and ended in a traceback.
    for batch in (24, 10**12):
        with pytest.raises(EmptyDatasetError, match=rf"records number 23, fewer than one global batch of {batch}"):
            train_stream(records(), batch=batch)
    assert len(next(iter(train_stream(records(), batch=23)))["id"]) == 23

    class Ragged:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"a": np.zeros(2)} if i % 2 else {"a": np.zeros(2), "b": np.ones(1)}

    with pytest.raises(MissingKeyError, match=r"no key 'b'"):
        for _ in range(3):
            next(train_stream(Ragged(), batch=4, seed=0))
    stream = train_stream(records(), batch=4, seed=0)
    with pytest.raises(ForeignPositionError, match="not written by train_stream"):
        stream.set_state(b"17")
    with pytest.raises(PositionMismatchError, match="seed 5"):
        stream.set_state(train_stream(records(), batch=4, seed=5).get_state())
    # (a resume with another val_fraction holds another share out: named beside an edit, not blamed on it)
    with pytest.raises(PositionMismatchError, match="over 23 records, this source holds 30: the data changed since "
                                                    r"the checkpoint, or another val_fraction or val_seed"):
        train_stream(records(30), batch=4).set_state(stream.get_state())
    # As many records, other contents (a corpus edited in place): the position would point into other data.
    edited = ArrayRecords({"id": np.arange(N, dtype=np.int64), "x": np.arange(N * 3).reshape(N, 3) + 1})
    with pytest.raises(PositionMismatchError, match="as many records, other contents"):
        train_stream(edited, batch=4).set_state(stream.get_state())
    train_stream(records(), batch=4).set_state(stream.get_state())  # the same data resumes


# -- real processes ------------------------------------------------------------------------

POOL_SCRIPT = """
import json, sys
import numpy as np

def main():
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    from dew.data.base import DataPartition
    from dew.data.sources import ArrayRecords
    from dew.data.stream import train_stream
    source = ArrayRecords({"id": np.arange(23)})
    partition = DataPartition(share=jax.process_index(), shares=jax.process_count())
    stream = train_stream(source, batch=6, seed=1, partition=partition)
    rows = [next(stream)["id"].tolist() for _ in range(4)]
    position = stream.get_state().decode()
    rows += [next(stream)["id"].tolist() for _ in range(3)]
    json.dump({"rows": rows, "position": position}, open(out, "w"))
    jax.distributed.shutdown()

if __name__ == "__main__":
    main()
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return env


@pytest.mark.slow
def test_a_two_process_pool_reads_the_one_process_order(tmp_path: Path):
    script = tmp_path / "pool.py"
    script.write_text(textwrap.dedent(POOL_SCRIPT))
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(r), str(outs[r])],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    got = [json.loads(o.read_text()) for o in outs]
    one = take(train_stream(records(), batch=6, seed=1), 7)
    for g in range(7):
        assert got[0]["rows"][g] + got[1]["rows"][g] == one[g].tolist()
    # Both ranks saved the same global position; one process resumes from it.
    assert got[0]["position"] == got[1]["position"]
    single = train_stream(ArrayRecords({"id": np.arange(23)}), batch=6, seed=1)  # the ranks' own source
    single.set_state(got[1]["position"].encode())
    assert [b.tolist() for b in take(single, 3)] == [b.tolist() for b in one[4:7]]


WORKERS_SCRIPT = """
import json, sys
import numpy as np

def main():
    # No absl flag parsing here: a script of the user's (or dew train) never parses them, and
    # Grain's workers read its flags (they failed with UnparsedFlagAccessError).
    from dew.data.sources import ArrayRecords
    from dew.data.stream import train_stream
    source = ArrayRecords({"id": np.arange(23), "x": np.arange(23 * 5).reshape(23, 5)})
    # 7 steps without workers, 5 with two (resumed from the first's position), then 3
    # without again (resumed from the second's): one spawn covers both directions.
    plain = train_stream(source, batch=4, seed=9, workers=0)
    rows = [next(plain)["id"].tolist() for _ in range(7)]
    pooled = train_stream(source, batch=4, seed=9, workers=2)
    pooled.set_state(plain.get_state())
    rows += [next(pooled)["id"].tolist() for _ in range(5)]
    again = train_stream(source, batch=4, seed=9, workers=0)
    again.set_state(pooled.get_state())
    pooled.close()
    rows += [next(again)["id"].tolist() for _ in range(3)]
    out = {"rows": rows}
    json.dump(out, open(sys.argv[1], "w"))

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_workers_give_the_same_stream_and_positions_cross_worker_counts(tmp_path: Path):
    script = tmp_path / "workers.py"
    script.write_text(textwrap.dedent(WORKERS_SCRIPT))
    out = tmp_path / "out.json"
    result = subprocess.run([sys.executable, str(script), str(out)], env=_env(), capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    got = json.loads(out.read_text())
    reference = [b.tolist() for b in take(train_stream(records(), batch=4, seed=9), 15)]
    assert got["rows"] == reference


ORPHANS_SCRIPT = """
import multiprocessing, sys, time
import numpy as np

def main():
    from dew.data.sources import ArrayRecords
    from dew.data.stream import train_stream
    stream = train_stream(ArrayRecords({"id": np.arange(23)}), batch=4, seed=9, workers=2)
    next(stream)
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    main()
"""


def _running(pid: int) -> bool:
    """Whether pid is a process still running (an exited one may linger as a zombie nobody reaps)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_reading_workers_end_when_their_process_is_killed(tmp_path: Path):
    """A kill -9 sends the workers nothing: they went on running as orphans, 200 MB each."""
    import signal
    import time

    script = tmp_path / "orphans.py"
    script.write_text(textwrap.dedent(ORPHANS_SCRIPT))
    process = subprocess.Popen([sys.executable, str(script)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        children = [int(pid) for pid in process.stdout.readline().split()]
        assert len(children) >= 2 and all(_running(pid) for pid in children), children
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    deadline = time.monotonic() + 20
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in children if _running(pid)]
    for pid in left:  # not to leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived the process that started them"


HELD_SCRIPT = """
import sys
import numpy as np

def main():
    from dew.data.sources import ArrayRecords
    from dew.data.stream import train_stream
    stream = train_stream(ArrayRecords({"x": np.arange(100000, dtype=np.float32).reshape(-1, 10)}), batch=256,
                          seed=0, workers=2)
    held = [next(stream) for _ in range(5)]  # a run holds its last batches as it stops
    stream.close()
    print(sorted({type(batch["x"]).__name__ for batch in held}), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_batches_read_by_workers_leave_no_shared_memory_behind(tmp_path: Path):
    """Batches came back in the workers' shared memory, let go of only at exit: a run stopped by
    SIGTERM ended with the resource tracker's warning of leaked shared_memory objects."""
    script = tmp_path / "held.py"
    script.write_text(textwrap.dedent(HELD_SCRIPT))
    result = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["['ndarray']"]
    assert "leaked" not in result.stderr and "Traceback" not in result.stderr, result.stderr
