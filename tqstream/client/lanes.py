"""Calls of a remote client, run on the caller's thread or loop.

A client's sockets normally live on its IO thread (``loop.py``), and a call waits there. That
costs two thread hand-overs per call (caller → IO thread → caller), as much as the network
exchange itself on a small machine. So callers get *lanes* of their own: their own ZMQ context and
:class:`ClientCore` (connections to the controller and units).

- A thread that makes sync calls gets a :class:`Lane`: a private asyncio loop, current on that
  thread for the length of a call but run only when the call waits for something other than a
  reply (a connection being opened, requests to several storage units at once). A request waits
  for its reply by polling its sockets (``Connection.request``), with no task and no loop
  iterations. Between calls nothing runs: ZMQ keeps the connections (heartbeats included) on its
  own I/O thread, and the connection events that queued are taken in before the next call.
- An event loop on which ``async_`` methods are awaited gets a :class:`LoopLane`: a core whose
  sockets that loop watches, so an async call never leaves the caller's loop.

Lanes are used by clients of a cluster in other processes. An embedded client keeps the IO
thread: its servers run there, and a lane would put every exchange across threads. A sync call
made inside a running event loop uses the IO thread too (a lane cannot run in a thread that runs a
loop), as does an async call on a loop that cannot watch file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import zmq

from tqstream.client.core import ClientCore
from tqstream.config import ClientConfig
from tqstream.errors import ClosedError
from tqstream.protocol.transport import context
from tqstream.types import BatchMeta

T = TypeVar("T")

CLOSED = (
    "this tqstream client is closed; create a new one with tqstream.init() or tqstream.connect()"
)


class Lane:
    """One thread's loop, context and core. ``busy`` is guarded by the owning :class:`Lanes`."""

    def __init__(
        self,
        address: str,
        config: ClientConfig,
        release: Callable[[BatchMeta], None],
        session: bytes,
        cluster: str,
    ) -> None:
        self.thread = threading.current_thread()
        self.busy = False
        self.loop = asyncio.new_event_loop()
        self.ctx = context()
        # a byte on this pair ends a request waiting on the lane's thread (interrupt())
        self._wake, self._waker = socket.socketpair()
        try:
            self.core = self.loop.run_until_complete(
                _open(address, config, self.ctx, release, session, cluster)
            )
        except BaseException:
            self._close_sockets()
            raise
        self.core.wake_with(self._wake.fileno())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        self.core.check_links()
        return _drive(self.loop, coro)

    def interrupt(self) -> None:
        """From another thread: the lane's current call fails with ``ClosedError``."""
        self.loop.call_soon_threadsafe(self.core.close)  # a call that runs the loop
        with contextlib.suppress(OSError):
            self._waker.send(b"x")  # a request polling its sockets

    def close(self) -> None:
        """Only from the lane's thread, or while it is idle."""
        self.core.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.ctx.destroy(linger=0)
        self.loop.close()
        self._wake.close()
        self._waker.close()


def _drive(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on this thread with ``loop`` current, without a task: its requests wait for
    their replies themselves, and whatever else it awaits runs the loop until done (the future
    then gives the coroutine its result, as a task would). An interruption (Ctrl-C) while the
    loop runs cancels what the coroutine awaits, lets it clean up (a put is rolled back) and is
    raised."""
    interrupted: BaseException | None = None
    while True:
        asyncio._set_running_loop(loop)
        try:
            awaited = coro.send(None)
        except StopIteration as done:
            if interrupted is None:
                return done.value  # type: ignore[no-any-return]
            raise interrupted from None
        except BaseException:
            if interrupted is None:
                raise
            raise interrupted from None
        finally:
            asyncio._set_running_loop(None)
        if awaited is None:  # a bare yield (asyncio.sleep(0)): nothing to wait for
            continue
        try:
            loop.run_until_complete(awaited)
        except BaseException as exc:
            if not awaited.done():  # interrupted while waiting: cancel, as a task would be
                interrupted = interrupted or exc
                awaited.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(awaited)
        # else the coroutine takes the future's error itself when resumed


class LoopLane:
    """One event loop's context and core, opened on that loop by the first call that needs it."""

    def __init__(
        self,
        address: str,
        config: ClientConfig,
        release: Callable[[BatchMeta], None],
        session: bytes,
        cluster: str,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.ctx = context()
        self._address, self._config, self._release = address, config, release
        self._session, self._cluster = session, cluster
        self._opening: asyncio.Task[ClientCore] | None = None
        self.unsupported = False  # the loop cannot watch file descriptors (add_reader)

    def move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``loop`` (call on it) with the connections of this lane's closed loop: a new
        loop per step (``asyncio.run``) then costs no new context and no new handshakes."""
        self.loop = loop
        task = self._opening
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            task.result().move_to(loop)
        else:
            self._opening = None

    async def core(self) -> ClientCore:
        """The lane's core; a failed open is retried by the next call."""
        task = self._opening
        if task is not None and task.done() and not task.cancelled() and not task.exception():
            return task.result()  # every call but the first: no shield (a future each)
        if task is None or (task.done() and task.exception() is not None):
            task = self._opening = self.loop.create_task(
                _open(
                    self._address,
                    self._config,
                    self.ctx,
                    self._release,
                    self._session,
                    self._cluster,
                ),
                name="tqstream-client-open-lane",
            )
        return await asyncio.shield(task)

    def close(self) -> None:
        """Close the sockets on the lane's loop: now when that is possible from here (this is
        the loop's thread, or the loop does not run), else as the loop's next callback."""
        if self.loop.is_closed() or not self.loop.is_running() or _running() is self.loop:
            self._close_now()
        else:
            with contextlib.suppress(RuntimeError):  # closed since: nothing runs on it any more
                self.loop.call_soon_threadsafe(self._close_now)

    def _close_now(self) -> None:
        task = self._opening
        if task is not None:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()
            elif not task.done():
                task.cancel()
        self.ctx.destroy(linger=0)


async def _open(
    address: str,
    config: ClientConfig,
    ctx: zmq.Context[Any],
    release: Callable[[BatchMeta], None],
    session: bytes,
    cluster: str,
) -> ClientCore:
    """A lane's core: its loop runs only during calls (or may end), so a lease it gives back goes
    through ``release`` (the IO thread) instead of a background task of its own."""
    core = await ClientCore.open(address, config, ctx, session, cluster)
    core.release_elsewhere = release
    return core


def _running() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Lanes:
    """The lanes of one client, by thread and by event loop; ``release`` sends a lease to the IO
    thread's core (what a failed get gives back must not wait for a lane's next call)."""

    def __init__(
        self,
        address: str,
        config: ClientConfig,
        release: Callable[[BatchMeta], None],
        io_loop: asyncio.AbstractEventLoop,
        session: bytes,
        cluster: str,
    ) -> None:
        self._address, self._config, self._release = address, config, release
        self._session, self._cluster = session, cluster
        self._io_loop = io_loop
        self._lock = threading.Lock()
        self._lanes: dict[threading.Thread, Lane] = {}
        self._loop_lanes: dict[asyncio.AbstractEventLoop, LoopLane] = {}
        self._closed = False

    async def core(self) -> ClientCore | None:
        """The core of the running loop's lane; None when the call must go to the IO thread."""
        loop = asyncio.get_running_loop()
        if loop is self._io_loop:
            return None
        self._check()
        # one dict read, no lock: a close racing with it is the race a call right after the lock
        # would run too (the lane's calls then fail closed)
        lane = self._loop_lanes.get(loop) or self._lane_of(loop)
        if lane.unsupported:
            return None
        try:
            return await lane.core()
        except NotImplementedError:  # e.g. a proactor loop: no add_reader
            lane.unsupported = True
            return None

    def _lane_of(self, loop: asyncio.AbstractEventLoop) -> LoopLane:
        """``loop``'s lane, made on its first call."""
        with self._lock:
            self._check()
            lane = self._loop_lanes.get(loop)
            if lane is None:
                # loops that ended (e.g. one asyncio.run per step): the first lane that works
                # moves to this loop, the others close
                gone = [self._loop_lanes.pop(o) for o in list(self._loop_lanes) if o.is_closed()]
                usable = [g for g in gone if not g.unsupported]
                if usable:
                    lane = usable.pop(0)
                    lane.move_to(loop)
                else:
                    lane = LoopLane(
                        self._address, self._config, self._release, self._session, self._cluster
                    )
                self._loop_lanes[loop] = lane
                for old in gone:
                    if old is not lane:
                        old.close()
        return lane

    def enter(self) -> Lane | None:
        """The calling thread's lane, marked busy; None when the call must go to the IO thread
        (a loop runs in this thread, or this thread is already inside a call)."""
        if _running() is not None:
            return None
        me = threading.current_thread()
        with self._lock:
            self._check()
            lane = self._lanes.get(me)
            if lane is not None:
                if lane.busy:
                    return None
                lane.busy = True
                return lane
        # a handshake: outside the lock
        lane = Lane(self._address, self._config, self._release, self._session, self._cluster)
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
        """Close idle thread lanes now; a busy one is interrupted (its call raises
        ``ClosedError``) and closes when its call returns. Loop lanes close on their loops."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
            idle = [lane for lane in lanes if not lane.busy]
            for lane in lanes:
                if lane.busy:
                    lane.interrupt()
            loop_lanes = list(self._loop_lanes.values())
            self._loop_lanes.clear()
        for lane in idle:
            lane.close()
        for loop_lane in loop_lanes:
            loop_lane.close()

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(CLOSED)
