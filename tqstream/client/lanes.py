"""Sync calls of a remote client, run on the calling thread.

A client's sockets normally live on its IO thread (``loop.py``), and a sync call waits there. That
costs two thread hand-overs per call (caller → IO thread → caller), as much as the network
exchange itself on a small machine. So each thread that makes sync calls gets a *lane*: its own
asyncio loop, ZMQ context and :class:`ClientCore`, driven by that thread for the length of a
call. Between calls nothing runs on a lane: ZMQ keeps the connections (heartbeats included) on its
own I/O thread, and the connection events that queued are taken in before the next call.

Lanes are used by clients of a cluster in other processes. An embedded client keeps the IO
thread: its servers run there, and a lane would put every exchange across threads. Calls made
from inside a running event loop keep it too (a lane cannot run in a thread that runs a loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import zmq

from tqstream.client.core import ClientCore
from tqstream.config import ClientConfig
from tqstream.errors import ClosedError
from tqstream.types import BatchMeta

T = TypeVar("T")

CLOSED = (
    "this tqstream client is closed; create a new one with tqstream.init() or tqstream.connect()"
)


class Lane:
    """One thread's loop, context and core. ``busy`` is guarded by the owning :class:`Lanes`."""

    def __init__(self, address: str, config: ClientConfig) -> None:
        self.thread = threading.current_thread()
        self.busy = False
        self.loop = asyncio.new_event_loop()
        self.ctx = zmq.Context[Any]()
        try:
            self.core = self.loop.run_until_complete(ClientCore.open(address, config, self.ctx))
        except BaseException:
            self.ctx.destroy(linger=0)
            self.loop.close()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        self.core.check_links()
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            if not task.done():  # interrupted between steps (KeyboardInterrupt): let it clean up
                task.cancel()
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(task)
            raise

    def close(self) -> None:
        """Only from the lane's thread, or while it is idle."""
        self.core.close()
        self.ctx.destroy(linger=0)
        self.loop.close()


class Lanes:
    """The lanes of one client, by thread; ``release`` sends a lease to the IO thread's core
    (what a failed get gives back must not wait for this thread's next call)."""

    def __init__(
        self, address: str, config: ClientConfig, release: Callable[[BatchMeta], None]
    ) -> None:
        self._address, self._config, self._release = address, config, release
        self._lock = threading.Lock()
        self._lanes: dict[threading.Thread, Lane] = {}
        self._closed = False

    def enter(self) -> Lane | None:
        """The calling thread's lane, marked busy; None when the call must go to the IO thread
        (a loop runs in this thread, or this thread is already inside a call)."""
        try:
            asyncio.get_running_loop()
            return None
        except RuntimeError:
            pass
        me = threading.current_thread()
        with self._lock:
            self._check()
            lane = self._lanes.get(me)
            if lane is not None:
                if lane.busy:
                    return None
                lane.busy = True
                return lane
        lane = Lane(self._address, self._config)  # outside the lock: a handshake
        lane.core.release_elsewhere = self._release
        lane.busy = True
        with self._lock:
            closed = self._closed
            if not closed:
                dead = [t for t, o in self._lanes.items() if not t.is_alive() and not o.busy]
                for t in dead:  # their threads are gone: closing from here is safe
                    self._lanes.pop(t).close()
                self._lanes[me] = lane
        if closed:
            lane.close()
            self._check()
        return lane

    def leave(self, lane: Lane) -> None:
        with self._lock:
            lane.busy = False
            closed = self._closed
        if closed:
            lane.close()

    def close(self) -> None:
        """Close idle lanes now; a busy one is interrupted (its call raises ``ClosedError``) and
        closes when its call returns."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
            idle = [lane for lane in lanes if not lane.busy]
            for lane in lanes:
                if lane.busy:
                    lane.loop.call_soon_threadsafe(lane.core.close)
        for lane in idle:
            lane.close()

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(CLOSED)
