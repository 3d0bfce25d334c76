"""ZMQ transport: one ROUTER socket per server, one DEALER socket per client connection.

Many requests share one socket: each request carries a fresh ``rid`` and its reply echoes it, so
replies may come back in any order (a parked ``get_meta`` is passed by later requests). Frame 0 of
a message is the msgpack header (:mod:`tqstream.protocol.messages`); frames 1..n are tensor buffers,
sent without copying from ``COPY_THRESHOLD`` (256 KiB) up and received as ``zmq.Frame``\\ s
whose memory the caller may keep (the storage unit stores received frames as they are).

Failure handling is the point of this module. A server survives anything a peer sends: every
per-message step is guarded, and a bad message gets an ``ErrorReply`` rather than silence. A client
never waits forever on a dead server: ZMQ would silently reconnect and the reply would be lost, so a
monitor fails every pending request with ``ConnectionLostError`` when the TCP connection drops
(heartbeats turn a silent peer into a drop), and a request made while the connection is down waits
at most ``connect_timeout`` for ZMQ to reconnect. Everything runs on the caller's asyncio loop;
a request made while that loop is current but not running (a sync call on a client lane) waits for
its reply by polling its sockets on the calling thread, with the same deadlines and link checks.

Sockets are plain (blocking-API) ZMQ sockets driven by the loop directly: the loop watches each
socket's ZMQ file descriptor and, when it signals, drains every pending message with non-blocking
receives and handles it in the same callback; sends never block (``SNDHWM`` 0). That costs one loop
wake-up per burst of messages instead of a future and a task step per message, which is most of a
small request's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import math
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from tqstream.errors import (
    ClosedError,
    ConnectError,
    ConnectionLostError,
    InternalError,
    MalformedMessageError,
    MessageTooLargeError,
    ProtocolVersionError,
    RequestTimeoutError,
    TQStreamError,
    error_class,
)
from tqstream.protocol.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Welcome,
    check_request,
    decode_reply,
    decode_request,
    encode,
)

__all__ = [
    "Connection",
    "Handler",
    "HandlerResult",
    "Responder",
    "Server",
    "error_from_reply",
    "error_reply",
]

MiB = 1 << 20
HandlerResult = Any | tuple[Any, Sequence[Any]] | Awaitable[Any] | None
Handler = Callable[[Any, list[zmq.Frame], "Responder"], HandlerResult]


_ENDPOINTS = itertools.count()
"""Numbers inproc endpoint names: ``id()`` values are reused, and libzmq releases a closed
socket's endpoint asynchronously, so a reused name could still be taken."""


COPY_THRESHOLD = 256 * 1024
"""Frames smaller than this are copied into the message when sent (pyzmq's default: 64 KiB).
A zero-copy send makes libzmq hand the buffer back through pyzmq's garbage-collector thread — a
thread wake-up and a GIL hand-over per frame, which costs more than copying a few hundred KiB."""


_OWNED: weakref.WeakSet[Any] = weakref.WeakSet()


def context() -> zmq.Context[Any]:
    """A new ZMQ context that a forked child will never tear down (see :func:`_disown`)."""
    ctx = zmq.Context[Any]()
    _OWNED.add(ctx)
    return ctx


def shared_context() -> zmq.Context[Any]:
    """pyzmq's process-wide context (the servers' default), disowned in forked children too."""
    ctx = zmq.Context[Any].instance()
    _OWNED.add(ctx)
    return ctx


def _disown() -> None:
    """A forked child (a DataLoader worker, a multiprocessing pool) inherits this process's ZMQ
    contexts and sockets, but their libzmq state (I/O threads, mailboxes) still belongs to the
    parent: a child that closed one, e.g. in a ``__del__`` during its garbage collection, would
    tear down the parent's live socket. In the child they become shadows, which pyzmq never
    closes; the child opens connections of its own."""
    for obj in list(_OWNED):
        obj._shadow = True


os.register_at_fork(after_in_child=_disown)


def _socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A socket with the blocking API (also from a ``zmq.asyncio`` context), closed by
    ``ctx.destroy()`` like any other."""
    sock = ctx.socket(kind, socket_class=zmq.Socket)
    sock.copy_threshold = COPY_THRESHOLD
    _OWNED.add(sock)
    return sock


def _fd(sock: zmq.Socket[Any]) -> int:
    return int(sock.getsockopt(zmq.FD))


_EVENTS, POLLIN, POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
"""Plain ints: pyzmq's enum members make every ``&`` build an enum (a few µs per message)."""


def _events(sock: zmq.Socket[Any]) -> int:
    return int(sock.get(_EVENTS))


def _op(msg: msgspec.Struct) -> str:
    return str(msg.__struct_config__.tag)


def _nbytes(buf: Any) -> int:
    return memoryview(getattr(buf, "buffer", buf)).nbytes


def _peek(header: Any) -> dict[Any, Any]:
    """Frame 0 decoded as plain msgpack: recovers ``rid``/``op`` of a message that failed typing."""
    try:
        value = msgspec.msgpack.decode(header)
    except Exception:  # garbage, or nested deeper than the decoder allows
        return {}
    return value if isinstance(value, dict) else {}


def _rid_of(fields: dict[Any, Any]) -> int:
    rid = fields.get("rid")
    return rid if type(rid) is int and 0 <= rid < 1 << 64 else 0


def _plain(value: Any) -> Any:
    """``details`` made msgpack-able: basic values kept, containers walked, the rest as ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def _version_error(
    ours: Any, role: str, server: str, address: str, theirs: Any = PROTOCOL_VERSION
) -> ProtocolVersionError:
    return ProtocolVersionError(
        f"protocol mismatch: the {role} speaks tqstream protocol {ours}, the {server} server at "
        f"{address} speaks protocol {theirs}; install the same tqstream version on both sides",
        client_protocol=ours,
        server_protocol=theirs,
    )


# --- server ---
class Responder:
    """The way back to one request: (peer identity, rid). A handler that returns None keeps it and
    answers later (a parked request); it stays valid until the server closes, after which answers
    are dropped (the peer's connection fails on its own). Answering twice is a bug and raises."""

    __slots__ = ("_identity", "_server", "answered", "op", "rid")

    def __init__(self, server: Server, identity: bytes, rid: int, op: str) -> None:
        self._server, self._identity, self.rid, self.op = server, identity, rid, op
        self.answered = False

    def reply(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        if self.answered:
            raise InternalError(f"{self.op} (request {self.rid}) was answered twice")
        if msg.rid != self.rid:
            msg = msgspec.structs.replace(msg, rid=self.rid)
        self._server._send(self._identity, msg, buffers)
        self.answered = True

    def fail(self, exc: BaseException) -> None:
        """Answer with ``exc`` as an ``ErrorReply`` (see :func:`error_reply`)."""
        where = f"the {self._server.name} server failed on {self.op} (request {self.rid})"
        self.reply(error_reply(exc, where, self.rid))


def error_reply(exc: BaseException, where: str, rid: int = 0) -> ErrorReply:
    """``exc`` for the wire: a TQStreamError travels as its own class, anything else as
    ``InternalError`` naming the exception and ``where`` it happened."""
    if isinstance(exc, TQStreamError):
        return ErrorReply(rid=rid, code=exc.code, message=exc.message, details=_plain(exc.details))
    kind = type(exc).__name__
    text = f"{where}: {kind}: {exc}"
    return ErrorReply(rid=rid, code=InternalError.code, message=text, details={"exception": kind})


def error_from_reply(reply: ErrorReply) -> TQStreamError:
    """The exception an ``ErrorReply`` stands for, of the class the server raised."""
    cls = error_class(reply.code)
    try:
        return cls(reply.message, **reply.details)
    except TypeError:  # details that clash with the constructor's own parameters
        return cls(reply.message)


class Server:
    """A ROUTER socket bound at construction (so ``address`` is known before ``serve``) and a
    receive loop that hands each request to ``handler`` in arrival order, on the caller's loop."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        host: str,
        port: int,
        handler: Handler,
        *,
        name: str,
        max_message_bytes: int,
        units: Callable[[], list[str]] = lambda: [],
        inproc_units: Callable[[], list[str]] = lambda: [],
        shm: str = "",
        inproc: bool = False,
    ) -> None:
        """``inproc``: also bind an ``inproc://`` endpoint (``inproc_address``) for clients in this
        process that share ``ctx``; they skip TCP and libzmq's I/O thread."""
        self.name = name
        self.max_message_bytes = max_message_bytes
        self._handler = handler
        self._units = units
        self._inproc_units = inproc_units
        self._shm = shm
        self.inproc_address = ""
        self._closed = False
        self._failure: BaseException | None = None
        self._done: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        sock = _socket(ctx, zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a vanished peer is dropped
            sock.setsockopt(zmq.SNDHWM, 0)  # at a full pipe ROUTER drops replies: never let it
            # libzmq drops a peer that sends a frame over this, before it is ever buffered
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + MiB)
            sock.bind(f"tcp://{host}:{port}")
            self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if inproc:
                self.inproc_address = f"inproc://tqstream-{name}-{next(_ENDPOINTS)}"
                sock.bind(self.inproc_address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(
                exc.errno, f"the {name} server cannot bind tcp://{host}:{port}: {exc.strerror}"
            ) from exc
        self._sock = sock
        self._fd = _fd(sock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self) -> None:
        """Serve until ``close()``; then return. Raises only what breaks the server itself (never
        something a peer sent), e.g. a handler bug that answered a request twice."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            return
        if self._done is not None:
            raise RuntimeError(f"the {self.name} server is already serving")
        loop = self._loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # messages that arrived before the reader was added
        try:
            await asyncio.shield(self._done)
        finally:
            self._stop_reading()
        if self._failure is not None:
            raise self._failure

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._sock.closed:
            self._loop.remove_reader(self._fd)

    async def close(self) -> None:
        """Stop receiving, cancel in-flight handler tasks, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        self._sock.close(linger=0)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _drain(self) -> None:
        """Handle every message waiting on the socket (the ZMQ fd is edge-triggered: it signals
        once for any number of messages, so stopping early would strand the rest)."""
        sock = self._sock
        self._draining = True
        try:
            while not self._closed and self._failure is None and _events(sock) & POLLIN:
                self._dispatch(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        finally:
            self._draining = False

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        """Handle one message; whatever goes wrong becomes an ``ErrorReply`` to its sender."""
        identity, payload = frames[0].bytes, frames[1:]
        responder = Responder(self, identity, 0, "request")
        try:
            if not payload:
                raise MalformedMessageError(
                    "the message has no frames after the peer identity; "
                    "frame 0 must be a msgpack-encoded tqstream request"
                )
            header = payload[0].buffer
            size = sum(len(f) for f in payload)
            if size > self.max_message_bytes:
                fields = _peek(header)
                responder.rid, responder.op = _rid_of(fields), str(fields.get("op", "request"))
                raise MessageTooLargeError(
                    f"{responder.op} message of {size} bytes exceeds the {self.name} server's "
                    f"max_message_bytes of {self.max_message_bytes}; split the batch into smaller "
                    f"ones or raise max_message_bytes on both sides",
                    nbytes=size,
                    max_message_bytes=self.max_message_bytes,
                )
            msg = self._decode(header, responder)
            responder.rid, responder.op = msg.rid, _op(msg)
            if isinstance(msg, Hello):
                responder.reply(self._welcome(msg))
                return
            self._deliver(responder, self._handler(msg, payload, responder))
        except Exception as exc:
            self._answer_error(responder, exc)

    def _decode(self, header: memoryview, responder: Responder) -> Any:
        try:
            return decode_request(header)
        except Exception as exc:  # msgspec.DecodeError / ValidationError, or nesting too deep
            fields = _peek(header)
            responder.rid = _rid_of(fields)
            theirs = fields.get("protocol")
            if fields.get("op") == "hello" and theirs != PROTOCOL_VERSION:
                raise _version_error(
                    theirs, str(fields.get("role", "client")), self.name, self.address
                ) from None
            raise MalformedMessageError(
                f"request frame 0 ({header.nbytes} bytes) is not a tqstream protocol "
                f"{PROTOCOL_VERSION} request: {exc}",
                nbytes=header.nbytes,
            ) from None

    def _welcome(self, hello: Hello) -> Welcome:
        if hello.protocol != PROTOCOL_VERSION:
            raise _version_error(hello.protocol, hello.role, self.name, self.address)
        return Welcome(
            rid=hello.rid,
            protocol=PROTOCOL_VERSION,
            server=self.name,
            max_message_bytes=self.max_message_bytes,
            units=list(self._units()),
            shm=self._shm,
            inproc_units=list(self._inproc_units()),
        )

    def _deliver(self, responder: Responder, result: HandlerResult) -> None:
        if result is None:  # parked: the handler answers through the responder later
            return
        if inspect.isawaitable(result):
            task = asyncio.get_running_loop().create_task(
                self._finish(responder, result),
                name=f"tqstream-{self.name}-{responder.op}-{responder.rid}",
            )
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
            return
        if isinstance(result, tuple):
            reply, buffers = result
            responder.reply(reply, buffers)
        else:
            responder.reply(result)

    async def _finish(self, responder: Responder, awaitable: Awaitable[Any]) -> None:
        try:
            self._deliver(responder, await awaitable)
        except Exception as exc:
            self._answer_error(responder, exc)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._fatal(task.exception())  # type: ignore[arg-type]

    def _answer_error(self, responder: Responder, exc: BaseException) -> None:
        """Send ``exc`` to the requester; a failure that cannot go there (the request was already
        answered, or even an error reply cannot be sent) is a server bug and ends ``serve()``."""
        if responder.answered:
            self._fatal(exc)
            return
        try:
            responder.fail(exc)
        except Exception as bug:
            self._fatal(bug)

    def _fatal(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _send(self, identity: bytes, msg: Any, buffers: Sequence[Any]) -> None:
        if self._closed:
            return
        # copy=False: pyzmq still copies frames under COPY_THRESHOLD. With SNDHWM 0
        # a ROUTER send never blocks; what goes wrong (a buffer that is not a buffer) raises here,
        # to the code that answered.
        self._sock.send_multipart([identity, encode(msg), *buffers], zmq.NOBLOCK, copy=False)
        # a send may consume the fd's edge: if input is waiting, the fd will not say so again
        # (inside _drain, its loop looks again anyway)
        if self._loop is not None and not self._draining and _events(self._sock) & POLLIN:
            self._loop.call_soon(self._drain)


# --- client ---
class Connection:
    """One DEALER socket to one server, a reader task that matches replies to requests by ``rid``
    and a monitor task that watches the TCP connection. Open with :meth:`open` and keep it for the
    peer's lifetime: ZMQ reconnects by itself, so a request made after a drop is sent normally; if
    the server is not back within ``connect_timeout`` it fails rather than waiting forever."""

    welcome: Welcome

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        role: str,
        connect_timeout: float,
        heartbeat_interval: float,
        max_message_bytes: int,
    ) -> None:
        self.address, self.role = address, role
        self.max_message_bytes = max_message_bytes
        self._limit = max_message_bytes  # min(ours, the server's) once welcomed
        self._connect_timeout = connect_timeout
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._grace: dict[int, asyncio.TimerHandle] = {}  # requests sent while the link is down
        self._down = False
        self._closed = False
        self._broken: BaseException | None = None
        self._unsent: list[list[Any]] = []  # requests ZMQ would not take yet (never with HWM 0)
        self._poller: zmq.Poller | None = None  # for requests that wait without a running loop
        self.wake: int | None = None
        """A file descriptor that, once readable, ends a request waiting without a running loop
        with ``ClosedError`` (another thread closes the client: ``lanes.py``)."""
        # inproc passes buffers by pointer: copy what we send and what we receive, so neither
        # side's tensors alias the other's memory (what a socket between processes does anyway)
        self._inproc = address.startswith("inproc://")
        sock = _socket(ctx, zmq.DEALER)
        ivl = max(1, round(heartbeat_interval * 1000))
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_MONITOR_STOPPED
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # requests queue while (re)connecting, never block
            sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
            sock.setsockopt(zmq.HEARTBEAT_TTL, min(3 * ivl, 6_553_500))  # lets the server drop us
            # before connect(), so no event can be missed; a plain PAIR, like the socket itself
            endpoint = f"inproc://tqstream-monitor-{next(_ENDPOINTS)}"
            sock.monitor(endpoint, events)
            monitor = _socket(ctx, zmq.PAIR)
            monitor.connect(endpoint)
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:
                monitor.close(linger=0)
                raise ConnectError(
                    f"cannot connect to {address!r}: {exc.strerror}; an address looks like "
                    f"tcp://HOST:PORT",
                    address=address,
                ) from exc
        except BaseException:
            sock.close(linger=0)  # ends the monitor too
            raise
        self._sock, self._monitor = sock, monitor
        self._fds = (_fd(sock), _fd(monitor))
        loop = self._loop = asyncio.get_running_loop()
        loop.add_reader(self._fds[0], self._guard, self._read)
        loop.add_reader(self._fds[1], self._guard, self._watch)
        loop.call_soon(self._guard, self._watch)  # events queued before the reader was added

    @classmethod
    async def open(
        cls,
        ctx: zmq.Context[Any],
        address: str,
        *,
        role: str = "client",
        connect_timeout: float,
        heartbeat_interval: float,
        max_message_bytes: int,
    ) -> Connection:
        """Connect and handshake (``Hello`` → ``Welcome``) within ``connect_timeout``; never hangs,
        and closes the socket on any failure."""
        conn = cls(ctx, address, role, connect_timeout, heartbeat_interval, max_message_bytes)
        try:
            hello = Hello(rid=0, protocol=PROTOCOL_VERSION, role=role)
            try:
                reply, _ = await conn.request(hello, timeout=connect_timeout)
            except (RequestTimeoutError, ConnectionLostError):
                raise ConnectError(
                    f"no tqstream server answered at {address} within {connect_timeout}s; check "
                    f"the address and that the server (tqstream-launch or tqstream.init) is "
                    f"running",
                    address=address,
                    timeout=connect_timeout,
                ) from None
            if not isinstance(reply, Welcome):
                raise InternalError(f"{address} answered hello with {_op(reply)}, not welcome")
            if reply.protocol != PROTOCOL_VERSION:
                raise _version_error(PROTOCOL_VERSION, role, reply.server, address, reply.protocol)
        except BaseException:
            conn.close()
            raise
        conn.welcome = reply
        conn._limit = min(max_message_bytes, reply.max_message_bytes)
        return conn

    async def request(
        self, msg: msgspec.Struct, buffers: Sequence[Any] = (), *, timeout: float | None
    ) -> tuple[Any, list[zmq.Frame]]:
        """Send ``msg`` (its ``rid`` is replaced) and the buffers; return the reply and all its
        frames (frame 0 included, as ``BufferRef.frame`` counts). ``timeout=None`` waits until the
        reply, a lost connection or ``close()``; an ``ErrorReply`` is raised as its error class."""
        if self._closed:
            raise ClosedError(f"the connection to {self.address} is closed; open a new one")
        if self._broken is not None:
            raise InternalError(
                f"the connection to {self.address} is unusable: "
                f"{type(self._broken).__name__}: {self._broken}"
            ) from self._broken
        rid = next(self._rids)
        msg = msgspec.structs.replace(msg, rid=rid)
        op, header = _op(msg), encode(msg)
        check_request(header, op)
        size = len(header) + sum(_nbytes(b) for b in buffers)
        if size > self._limit:
            theirs = self.welcome.max_message_bytes if hasattr(self, "welcome") else "unknown"
            raise MessageTooLargeError(
                f"{op} message of {size} bytes exceeds the limit of {self._limit} bytes "
                f"(max_message_bytes is {self.max_message_bytes} on this {self.role} and {theirs} "
                f"on the server at {self.address}); split the batch into smaller ones or raise "
                f"max_message_bytes on both sides",
                nbytes=size,
                max_message_bytes=self._limit,
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[rid] = (fut, op)
        # a loop that is current but not running: a lane's sync call (lanes.py) that waits right
        # here, polling the sockets, which saves the loop's iterations and the task machinery
        waits_here = not loop.is_running()
        timer = None
        if not waits_here:
            if self._down:  # queued until ZMQ reconnects: wait for that at most connect_timeout
                self._grace[rid] = loop.call_later(self._connect_timeout, self._unreachable, rid)
            # a timer, not asyncio.wait_for: no extra task per request
            timer = None if timeout is None else loop.call_later(timeout, _expire, fut)
        try:
            self._send([header, *buffers])
            reply, frames = self._wait(fut, rid, timeout) if waits_here else await fut
        except _Expired:
            raise RequestTimeoutError(
                f"no reply to {op} (request {rid}) from the server at {self.address} within "
                f"{timeout}s; the server is busy or stuck, or the timeout is too short",
                op=op,
                address=self.address,
                timeout=timeout,
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(rid, None)
            grace = self._grace.pop(rid, None)
            if grace is not None:
                grace.cancel()
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply)
        return reply, frames

    def _send(self, frames: list[Any]) -> None:
        if self._unsent:  # keep the order
            self._unsent.append(frames)
        else:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=self._inproc)
            except zmq.Again:
                self._unsent.append(frames)
        # a send may consume the fd's edge: read what waits (a request in _wait reads anyway)
        if (self._unsent or _events(self._sock) & POLLIN) and self._loop.is_running():
            self._loop.call_soon(self._guard, self._read)

    def _wait(self, fut: asyncio.Future[Any], rid: int, timeout: float | None) -> Any:
        """Wait for ``fut`` on this thread without the loop: poll the socket, the monitor and
        ``wake``, and handle what they bring as the loop's readers would."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        grace = now + self._connect_timeout if self._down else None
        poller = self._poller
        if poller is None:
            poller = self._poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            if self.wake is not None:
                poller.register(self.wake, zmq.POLLIN)
        while not fut.done():
            limits = [t - now for t in (deadline, grace) if t is not None]
            ready = dict(poller.poll(math.ceil(max(0.0, min(limits)) * 1000) if limits else None))
            if self.wake is not None and self.wake in ready:
                self.close()  # fails fut with ClosedError
                break
            self._guard(self._watch)
            self._guard(self._read)
            now = time.monotonic()
            if fut.done():
                break
            if grace is not None and not self._down:
                grace = None  # reconnected
            elif grace is not None and now >= grace:
                self._unreachable(rid)
            elif deadline is not None and now >= deadline:
                raise _Expired
        return fut.result()

    def close(self) -> None:
        """Fail pending requests with ``ClosedError``, stop watching, close the sockets.
        Idempotent; call on the connection's loop thread (or while nothing else uses it)."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(
            ClosedError, "the connection to {address} was closed while waiting for {what}"
        )
        for fd in self._fds:
            self._loop.remove_reader(fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the sockets from ``loop`` instead; the old loop is closed, so nothing else uses
        them. Requests sent from the old loop have nobody waiting any more: forgotten."""
        self._pending.clear()
        self._grace.clear()
        self._loop = loop
        if self._closed or self._broken is not None:
            return
        loop.add_reader(self._fds[0], self._guard, self._read)
        loop.add_reader(self._fds[1], self._guard, self._watch)
        loop.call_soon(self._guard, self._watch)

    def check_link(self) -> None:
        """Handle the monitor's waiting connection events now (``ClientCore.check_links``)."""
        self._guard(self._watch)

    def _guard(self, body: Callable[[], None]) -> None:
        """A reader that fails takes the connection down with it: every pending and every later
        request raises the error instead of waiting for a reply nobody will match."""
        if self._closed or self._broken is not None:
            return
        try:
            body()
        except Exception as exc:
            error = self._broken = exc
            for fd in self._fds:
                self._loop.remove_reader(fd)
            for fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(error)

    def _read(self) -> None:
        sock = self._sock
        while True:
            events = _events(sock)
            if self._unsent and events & POLLOUT:
                with contextlib.suppress(zmq.Again):
                    while self._unsent:
                        sock.send_multipart(self._unsent[0], zmq.NOBLOCK, copy=self._inproc)
                        self._unsent.pop(0)
            if not events & POLLIN:
                return
            frames: list[Any] = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            header = frames[0].buffer
            try:
                reply = decode_reply(header)
            except Exception as exc:
                rid = _rid_of(_peek(header))
                fut, op = self._pending.get(rid, (None, ""))
                if fut is not None and not fut.done():
                    text = f"the reply from {self.address} to {op} (request {rid}) is not a "
                    text += f"tqstream protocol {PROTOCOL_VERSION} reply: {exc}"
                    fut.set_exception(MalformedMessageError(text))
                continue  # without a known rid nobody waits for it
            entry = self._pending.get(reply.rid)
            if entry is not None and not entry[0].done():  # else: late (timed out) or unknown
                if self._inproc and len(frames) > 1:  # they may alias the server's memory
                    frames[1:] = [bytearray(f.buffer) for f in frames[1:]]
                entry[0].set_result((reply, frames))

    def _watch(self) -> None:
        while _events(self._monitor) & POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down = False
                for grace in self._grace.values():
                    grace.cancel()
                self._grace.clear()
            elif event == zmq.EVENT_DISCONNECTED:  # the pending replies died with the connection
                self._down = True
                self._fail_all(ConnectionLostError, _LOST)

    def _unreachable(self, rid: int) -> None:
        self._grace.pop(rid, None)
        if self._down:
            self._fail_all(ConnectionLostError, _DOWN, only=rid)

    def _fail_all(self, cls: type[TQStreamError], text: str, only: int | None = None) -> None:
        for rid, (fut, op) in list(self._pending.items()):
            # a future of a closed loop has nobody waiting (and cannot take a result any more)
            if not fut.done() and only in (None, rid) and not fut.get_loop().is_closed():
                what, timeout = f"{op} (request {rid})", self._connect_timeout
                message = text.format(address=self.address, what=what, timeout=timeout)
                fut.set_exception(cls(message, address=self.address, op=op, rid=rid))


class _Expired(Exception):
    """A request's own timer fired before its reply came."""


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


_LOST = (
    "connection to {address} lost while waiting for {what}; the server may have died; the request "
    "may or may not have taken effect: retry once the server is back (the connection reconnects "
    "by itself)"
)
_DOWN = (
    "connection to {address} is down and no server came back within {timeout}s (connect_timeout) "
    "to answer {what}; the server may have died: retry once it is back (the connection reconnects "
    "by itself)"
)
