"""How fast dew-data feeds a trainer: tokens per second, and the share of a run spent waiting.

Prints, for the standard library corpus (every machine has it):

1. tokenization: TokenWindows' one-time pass, text -> packed int32 windows;
2. streaming: train_stream over those windows (what a run pays per step), at
   several window lengths, with 0 and 2 worker processes;
3. waiting: a small LM run (Trainer + LMObjective + causal_transformer on the
   same windows), with the wall time the loop spent in next() on the stream,
   both as measured here around the iterator and as the trainer's own Goodput
   record reports it (data_seconds).

Run: .venv/bin/python benchmarks/data_bench.py [--quick] [--stream-only]
Targets (issue 6): >= 1M tokens/s per host; data waiting <= 1% of wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def tokenization(length: int) -> tuple[Any, float]:
    from dew.data import TokenWindows
    from dew.data.sources import stdlib_corpus

    files = stdlib_corpus()
    began = time.perf_counter()
    windows = TokenWindows(files=files, length=length).windows()
    seconds = time.perf_counter() - began
    print(f"tokenize  {len(files)} stdlib files -> {windows.shape[0]} windows of {length + 1}: "
          f"{windows.size / seconds / 1e6:.1f} M tokens/s ({seconds:.2f} s, byte tokenizer)")
    return windows, seconds


def baseline(windows: Any, *, batch: int, steps: int) -> float:
    """Tokens per second of the bare minimum: a numpy gather of random rows, no pipeline."""
    import numpy as np

    rng = np.random.default_rng(0)
    began = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += windows[rng.integers(0, len(windows), batch)].size
    return tokens / (time.perf_counter() - began)


def streaming(windows: Any, *, batch: int, workers: int, steps: int) -> float:
    from dew.data.sources import ArrayRecords
    from dew.data.stream import train_stream

    floor = baseline(windows, batch=batch, steps=steps)

    stream = train_stream(ArrayRecords({"text": windows}), batch=batch, seed=0, workers=workers)
    next(stream)  # start-up (worker spawn) is not the steady rate
    began = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += next(stream)["text"].size
    rate = tokens / (time.perf_counter() - began)
    stream.close()
    print(f"stream    windows of {windows.shape[1]:5d}, batch {batch:3d}, workers {workers}: "
          f"{rate / 1e6:7.1f} M tokens/s ({rate / floor:.2f} x a bare numpy gather, "
          f"{floor / 1e6:.1f} M tokens/s)")
    return rate


class _Records:
    """A tracker that keeps the typed records (Goodput) the trainer reports."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def log(self, scalars: dict[str, float], step: int) -> None:
        pass

    def artifact(self, value: Any, step: int) -> None:
        self.records.append(value)

    def close(self) -> None:
        pass


class _Timed:
    """Wraps a stream; adds the seconds each next() takes to a shared total."""

    def __init__(self, stream: Any, total: list[float]) -> None:
        self.stream, self.total = stream, total

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        began = time.perf_counter()
        try:
            return next(self.stream)
        finally:
            self.total[0] += time.perf_counter() - began

    def get_state(self) -> bytes:
        return self.stream.get_state()

    def set_state(self, state: bytes) -> None:
        self.stream.set_state(state)

    def close(self) -> None:
        self.stream.close()


def waiting(*, length: int, batch: int, steps: int, workers: int) -> None:
    import jax
    import optax

    from dew import Dataset, Trainer, models
    from dew.data import TokenWindows
    from dew.data.sources import stdlib_corpus
    from dew.objectives.lm import LMObjective
    from dew.telemetry.records import Goodput

    data = TokenWindows(files=stdlib_corpus(limit_files=200), length=length).load(
        batch=batch, seed=0, workers=workers)
    total = [0.0]
    timed = Dataset(train=lambda partition: _Timed(data.train(partition), total), val=None,
                    records=data.records, batch=data.batch)
    model = models.build("causal_transformer", vocab_size=257, emb_features=64, num_layers=2,
                         num_heads=4, mlp_features=256, max_seq_len=length)
    tracker = _Records()
    trainer = Trainer(LMObjective(model, seq_len=length), optax.adamw(3e-3), key=jax.random.key(0),
                      tracker=tracker)
    began = time.perf_counter()
    trainer.fit(timed, steps=steps, log_every=max(1, steps // 4))
    wall = time.perf_counter() - began
    goodput = next((r for r in tracker.records if isinstance(r, Goodput)), None)
    print(f"wait      LM run, {steps} steps, batch {batch} x {length + 1} tokens, workers {workers}: "
          f"next() took {total[0]:.3f} s of {wall:.1f} s wall = {100 * total[0] / wall:.2f}% (target <= 1%)")
    if goodput is not None:
        steady = goodput.wall_seconds - goodput.first_step_seconds
        print(f"          trainer's Goodput: data_seconds {goodput.data_seconds:.3f} s = "
              f"{100 * goodput.data_seconds / goodput.wall_seconds:.2f}% of its wall (target <= 1%) "
              f"{goodput.wall_seconds:.1f} s ({100 * goodput.data_seconds / max(steady, 1e-9):.2f}% "
              f"after the first step)")


def main() -> None:
    from absl import flags

    flags.FLAGS(sys.argv[:1])  # Grain's worker processes read absl flags
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--stream-only", action="store_true", help="skip the LM run")
    args = parser.parse_args()
    steps = 50 if args.quick else 400
    windows, _ = tokenization(1024)
    rates = [streaming(windows, batch=32, workers=0, steps=steps)]
    for length in (64, 256):
        short, _ = tokenization(length)
        rates.append(streaming(short, batch=32, workers=0, steps=steps))
    rates.append(streaming(short, batch=32, workers=2, steps=steps))
    print(f"slowest stream: {min(rates) / 1e6:.1f} M tokens/s (target >= 1.0)")
    if not args.stream_only:
        waiting(length=128, batch=16, steps=20 if args.quick else 200, workers=0)


if __name__ == "__main__":
    main()
