"""Read a W&B offline run's .wandb datastore with W&B's own protobuf (for the tests)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

_BLOCK = 32 * 1024  # the datastore is a LevelDB-style log: 32 KiB blocks of framed chunks
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_datastore(path: Path) -> list:
    """Every Record in a W&B .wandb file, decoded with wandb's protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B datastore"
    position, pending, payloads = 7, b"", []
    while position + 7 <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == _FULL:
            payloads.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            payloads.append(pending + chunk)
        else:
            break
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def finished_records(path: Path, timeout: float = 60.0) -> list:
    """The datastore's records once W&B's service has written the run's exit record (it
    writes after finish() returns), waiting at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in read_datastore(path)):
        assert time.monotonic() < deadline, "W&B never finished writing the offline run"
        time.sleep(0.2)
    return read_datastore(path)
