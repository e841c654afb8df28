"""A TensorBoard event file as a dew tracker (tensorboard's writer, no TensorFlow)."""

from __future__ import annotations

import itertools
import json
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import is_record, previews_of, record_row
from dew.trackers import require
from dew.tracking.protocol import Reported, check_reported

__all__ = ["TensorBoardTracker"]


def _summarize(preview: Artifact) -> Any:
    """The summary value a preview becomes: an image (a GIF for a video) or a text."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.text.summary_v2 import text_pb

    from dew.telemetry.render import gif_bytes, image_grid, png_bytes

    tag = f"previews/{preview.name}"
    if preview.kind == "text":
        return text_pb(tag, str(preview.data)).value[0]
    pixels = np.asarray(preview.data)
    if preview.kind == "image":
        frame, encoded = image_grid(pixels), png_bytes(pixels)
    else:
        frame, encoded = image_grid(pixels[0]), gif_bytes(pixels)
    image = summary_pb2.Summary.Image(
        height=frame.shape[0], width=frame.shape[1], colorspace=frame.shape[2],
        encoded_image_string=encoded,
    )
    return summary_pb2.Summary.Value(tag=tag, image=image)


def _hparams(config: Mapping[str, Any]) -> Any:
    """The hparams plugin's session summary holding the recipe's flattened fields
    (built here from the plugin's protos: its own helper needs TensorFlow)."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2
    from tensorboard.util import tensor_util

    from dew.tracking.rows import recipe_fields

    session = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, value in recipe_fields(config).items():
        if isinstance(value, bool):
            session.hparams[name].bool_value = value
        elif isinstance(value, int | float):
            session.hparams[name].number_value = value
        else:
            session.hparams[name].string_value = str(value)
    data = plugin_data_pb2.HParamsPluginData(session_start_info=session)
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag=metadata.SESSION_START_INFO_TAG, metadata=metadata.create_summary_metadata(data),
        tensor=tensor_util.make_tensor_proto(0))])


def _crc32c() -> Any:
    """CRC-32C of bytes: google-crc32c's (C), else tensorboard's own (pure Python, ~50 us for
    one step's event; the tensorboard extra installs the former)."""
    try:
        from google_crc32c import value

        return value
    except ImportError:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c

        return crc32c


def masked_crc32c(data: bytes, crc32c: Any = None) -> int:
    """The TFRecord checksum of data: its CRC-32C rotated and offset (TFRecord's mask).

    >>> from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs
    >>> masked_crc32c(b"dew") == theirs(b"dew")
    True
    """
    crc = (crc32c or _crc32c())(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class _EventFile:
    """An event file written directly, one record per event, by the caller (dew's tracker
    thread): the same file and records as tensorboard's EventFileWriter, without the second
    thread that writer hands every event to (a thread switch per step), and with the records'
    checksums computed in C (tensorboard's RecordWriter computes them in Python)."""

    def __init__(self, directory: Path) -> None:
        import socket

        from tensorboard.compat.proto import event_pb2

        directory.mkdir(parents=True, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILES)}")
        self.path = directory / name
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._crc32c = _crc32c()
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2",
                                       source_metadata=event_pb2.SourceMetadata(writer="dew")))
        self.flush()

    def add_event(self, event: Any) -> None:
        """One TFRecord: the length, its checksum, the serialized event, its checksum."""
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(b"".join((
            header, struct.pack("<I", masked_crc32c(header, self._crc32c)), data,
            struct.pack("<I", masked_crc32c(data, self._crc32c)))))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


_FILES = itertools.count()


class TensorBoardTracker:
    """Writes scalars, previews and records into one TensorBoard event file in directory.

    The file is created when the first value arrives. Scalars are scalar
    summaries; a preview is an image summary (a video its animated GIF) or a
    text summary under ``previews/<name>``; a record is its JSON journal row
    as a text summary under ``reporting/<type>``. The recipe a RunStarted
    record carries also becomes the hparams plugin's session, its fields
    flattened to dotted names, so runs can be compared by them; it is also
    marked as a session start at the fit's first step, so TensorBoard drops
    what an earlier fit in the same directory logged past the checkpoint this
    one resumed from (the steps it trains again).

    Summaries are built and written by dew's tracker thread
    (dew.tracking.background), so a step only enqueues its values; a failure
    names the directory and is raised by the next call or by ``close``, unless
    stop_on_failure is False (then it is retried and warned of, and ``close``
    gives up after close_timeout seconds).
    """

    def __init__(self, directory: str | Path, *, stop_on_failure: bool = True,
                 close_timeout: float = 30.0) -> None:
        from dew.tracking.background import Channel

        require("tensorboard", "TensorBoardTracker")
        self.directory = Path(directory)
        self._writer: Any = None
        self._channel = Channel(self._send, f"TensorBoardTracker at {self.directory}",
                                interval=0.5, stop_on_failure=stop_on_failure,
                                close_timeout=close_timeout)

    @property
    def writer(self) -> _EventFile:
        """The event file, opened on first use."""
        if self._writer is None:
            self._writer = _EventFile(self.directory)
        return self._writer

    def _send(self, items: list[tuple[str, Any, int]]) -> None:
        """On the tracker thread: one event per call, then the file is flushed."""
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb

        from dew.telemetry.records import RunStarted
        from dew.tracking.background import let_others_run

        writer = self.writer
        for kind, value, step in items:
            let_others_run()
            if isinstance(value, RunStarted):  # a resume: what an earlier fit logged past its start is orphaned
                writer.add_event(event_pb2.Event(wall_time=time.time(), step=value.start + 1, session_log=(
                    event_pb2.SessionLog(status=event_pb2.SessionLog.START))))
            if kind == "log":
                values = [summary_pb2.Summary.Value(tag=name, simple_value=float(number))
                          for name, number in value.items()]
            else:
                values = []
                if is_record(value):
                    text = json.dumps(record_row(value, step), allow_nan=False)
                    values.append(text_pb(f"reporting/{value.type}", text).value[0])
                values += [_summarize(preview) for preview in previews_of(value)]
            summary = summary_pb2.Summary(value=values)
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                             summary=summary))
            if isinstance(value, RunStarted) and value.config:
                writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                                 summary=_hparams(value.config)))
        writer.flush()

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._channel.submit(("log", dict(scalars), step))

    def artifact(self, value: Reported, step: int) -> None:
        check_reported(value)
        self._channel.submit(("artifact", value, step))

    def flush(self) -> None:
        """Wait until every report so far is in the event file; raise what failed."""
        self._channel.flush()
        self._channel.check()

    def close(self) -> None:
        try:
            self._channel.close()
        finally:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()

    def directories(self) -> list[str]:
        return [str(self.directory)]

    def __repr__(self) -> str:
        return f"TensorBoardTracker({str(self.directory)!r})"
