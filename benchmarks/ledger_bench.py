"""What the data ledger costs a step: a train_stream's next() alone, and with the ledger's entry.

Each step the Feed asks the stream which global records its batch held
(``consumption()``: the global order at the batch's positions) and the ledger
digests them (sorted, SHA-256) and queues one JSON line. This prints, per
global batch size, the min and median of both over many steps, and the
ledger's share of the stream's own time, in the same run.

    .venv/bin/python benchmarks/ledger_bench.py [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from dew.cli.runs import positive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=300)
    args = parser.parse_args()

    import numpy as np

    from dew.data.base import DataPartition
    from dew.data.sources import ArrayRecords
    from dew.data.stream import StreamReader
    from dew.training.ledger import RecordLedger

    source = ArrayRecords({"tokens": np.zeros((1_000_000, 65), np.int32)})
    for batch in (32, 512, 4096):
        stream = StreamReader(source, batch=batch, seed=0)(DataPartition())
        next(stream)  # the pipeline's threads start
        with tempfile.TemporaryDirectory() as directory:
            ledger = RecordLedger(directory)
            ledger.opened(0, None, DataPartition())
            plain, entry = [], []
            for step in range(args.steps):
                began = time.perf_counter()
                next(stream)
                middle = time.perf_counter()
                ledger.consumed(step + 1, stream.consumption())
                entry.append(time.perf_counter() - middle)
                plain.append(middle - began)
            ledger.close()
        stream.close()
        print(f"batch {batch:>5}: next() min {min(plain) * 1e6:8.0f} us, median {statistics.median(plain) * 1e6:8.0f} us;"
              f" ledger entry min {min(entry) * 1e6:6.0f} us, median {statistics.median(entry) * 1e6:6.0f} us;"
              f" ratio (median) {statistics.median(entry) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    main()
