"""A sender thread for trackers whose backend is slow to call from the training loop.

The loop only enqueues; one daemon thread takes everything queued so far and
hands it, in order, to the tracker's ``send``, so a slow backend sees batches
rather than one call per step. A failure in the thread is raised by the next
``submit`` or by ``drain``, so it reaches the caller (and a Trackers fan-out)
instead of vanishing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Sender"]

_STOP = object()


class Sender:
    """Calls send(items) on a background thread with every item queued since the last call.

    interval > 0 makes the thread wait that long after the first item of a
    batch, so a backend with a high cost per request gets one request per
    interval rather than one per step.
    """

    def __init__(self, send: Callable[[list[Any]], None], name: str,
                 interval: float = 0.0) -> None:
        self._send = send
        self._name = name
        self._interval = interval
        self._hurry = threading.Event()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, item: Any) -> None:
        """Queue item; raise a failure the thread met since the last call."""
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(item)

    def check(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            if self._interval > 0:  # let a batch build up, unless drain() is waiting
                self._hurry.wait(self._interval)
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in items)
            items = [item for item in items if item is not _STOP]
            if items:
                try:
                    self._send(items)
                except Exception as error:  # noqa: BLE001 - surfaced on the caller's thread
                    if self._error is None:
                        self._error = error
            if stop:
                return

    def drain(self) -> None:
        """Send everything queued, stop the thread, and raise what failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            self._hurry.set()
            thread.join()
            self._hurry.clear()
        self.check()
