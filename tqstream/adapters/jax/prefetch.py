"""The prefetcher of an :class:`~tqstream.adapters.jax.ExperienceIterator`: a thread that leases
(and converts) batches ahead of the consumer, so reads go on while the trainer steps.

It waits for room before it leases, so at most ``depth`` batches are leased ahead of the one the
consumer holds (their leases run meanwhile). Its queue, room and stop flag are its own: one that
``close()`` stopped while a read was still in flight gives back whatever that read leases, and
never touches the queue of the prefetcher started after it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from tqstream.adapters.jax.batch import JaxBatch
from tqstream.client.batch import Batch
from tqstream.client.client import Client
from tqstream.errors import RequestTimeoutError

__all__ = ["Prefetcher"]


class Prefetcher:
    """Runs ``read(stop)`` ahead of :meth:`take`, in order. ``read`` returns a batch, ``end``
    (a finite stream ended: the thread ends), an exception to hand over (a
    ``RequestTimeoutError`` and the reads go on; any other ends the thread), or None once
    ``stop`` is set (it must not wait much longer than that: :meth:`close` waits for it)."""

    def __init__(
        self, read: Callable[[threading.Event], Any], depth: int, end: object, client: Client
    ) -> None:
        self._read, self._end, self._client = read, end, client
        self._items: queue.Queue[Any] = queue.Queue()
        self._room = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tqstream-jax-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._room.acquire()  # the consumer took an item, or close() woke this thread
            if self._stop.is_set():
                return
            item = self._read(self._stop)
            if item is None:
                return
            if self._stop.is_set():  # closed while the read was in flight
                self._give_back(item)
                return
            self._items.put(item)
            if item is self._end or (
                isinstance(item, BaseException) and not isinstance(item, RequestTimeoutError)
            ):
                return

    def take(self) -> Any:
        """The next outcome (waits for it); taking it makes room for one more read."""
        item = self._items.get()
        self._room.release()
        return item

    def close(self, wait: float = 10.0) -> None:
        """Stop, and give back the batches leased ahead."""
        self._stop.set()
        self._room.release()
        self._thread.join(wait)
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return
            self._give_back(item)

    def _give_back(self, item: Any) -> None:
        if isinstance(item, Batch | JaxBatch) and item.meta is not None:
            with contextlib.suppress(Exception):  # best effort: the lease expires anyway
                self._client.release(item.meta)
