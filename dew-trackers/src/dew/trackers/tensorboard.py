"""A TensorBoard event file as a dew tracker (tensorboard's writer, no TensorFlow)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import is_record, previews_of, record_row
from dew.trackers import require
from dew.training.trackers import Reported, check_reported

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


class TensorBoardTracker:
    """Writes scalars, previews and records into one TensorBoard event file in directory.

    The file is created when the first value arrives. Scalars are scalar
    summaries; a preview is an image summary (a video its animated GIF) or a
    text summary under ``previews/<name>``; a record is its JSON journal row
    as a text summary under ``reporting/<type>``.
    """

    def __init__(self, directory: str | Path) -> None:
        require("tensorboard", "tensorboard", "TensorBoardTracker")
        self.directory = Path(directory)
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """The event-file writer, opened on first use."""
        if self._writer is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = EventFileWriter(str(self.directory), max_queue_size=1000, flush_secs=10)
        return self._writer

    def _write(self, values: list[Any], step: int) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        event = event_pb2.Event(
            wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)
        )
        self.writer.add_event(event)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = [summary_pb2.Summary.Value(tag=name, simple_value=float(value))
                  for name, value in scalars.items()]
        self._write(values, step)

    def artifact(self, value: Reported, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        check_reported(value)
        values = []
        if is_record(value):
            text = json.dumps(record_row(value, step), allow_nan=False)
            values.append(text_pb(f"reporting/{value.type}", text).value[0])
        values += [_summarize(preview) for preview in previews_of(value)]
        self._write(values, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardTracker({str(self.directory)!r})"
