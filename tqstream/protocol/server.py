"""The server side of the transport: one ROUTER socket per server process.

A server survives anything a peer sends: every per-message step is guarded, and a bad message gets
an ``ErrorReply`` rather than silence. Each request is handed to the handler in arrival order on
the caller's asyncio loop; a handler answers at once, later through its :class:`Responder` (a
parked request), or with an awaitable the server runs as a task.

A server can also tell its owner when a peer's connection drops (``on_disconnect``): libzmq's
ROUTER does not say which peer a TCP disconnect was (its notification is a draft API), so the
server watches its socket monitor, whose events name the connection's file descriptor, and learns
each peer's descriptor from the first message it sends (``ZMQ_SRCFD``). A peer is a *session*:
the connections whose handshake named the same ``Hello.session`` (one client's connections, one
per thread or event loop), or a connection alone; it is gone once its last connection dropped. A
client that reconnects opens a new connection, so the dropped one counts as gone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from tqstream.errors import (
    InternalError,
    MalformedMessageError,
    MessageTooLargeError,
    TQStreamError,
)
from tqstream.protocol import auth
from tqstream.protocol.auth import Keys
from tqstream.protocol.messages import PROTOCOL_VERSION, Hello, Welcome, decode_request, encode
from tqstream.protocol.transport import (
    _ENDPOINTS,
    POLLIN,
    MiB,
    _events,
    _fd,
    _op,
    _peek,
    _rid_of,
    _socket,
    _version_error,
    error_reply,
    session_of,
)

__all__ = ["Handler", "HandlerResult", "Responder", "Server"]

_log = logging.getLogger("tqstream.server")

HandlerResult = Any | tuple[Any, Sequence[Any]] | Awaitable[Any] | None
Handler = Callable[[Any, list[zmq.Frame], "Responder"], HandlerResult]


class Responder:
    """The way back to one request: (peer identity, rid). A handler that returns None keeps it and
    answers later (a parked request); it stays valid until the server closes, after which answers
    are dropped (the peer's connection fails on its own). Answering twice is a bug and raises."""

    __slots__ = ("_identity", "_server", "answered", "op", "peer", "rid", "started")

    def __init__(self, server: Server, identity: bytes, rid: int, op: str) -> None:
        self._server, self._identity, self.rid, self.op = server, identity, rid, op
        self.answered = False
        self.started = time.perf_counter() if server.observe is not None else 0.0
        self.peer = server._sessions.get(identity, identity)
        """The session the request came from (what ``on_disconnect`` names once it is gone)."""

    def reply(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        if self.answered:
            raise InternalError(f"{self.op} (request {self.rid}) was answered twice")
        if msg.rid != self.rid:
            msg = msgspec.structs.replace(msg, rid=self.rid)
        self._server._send(self._identity, msg, buffers)
        self.answered = True
        if self._server.observe is not None:
            self._server.observe(self.op, self.started, msg)

    def fail(self, exc: BaseException) -> None:
        """Answer with ``exc`` as an ``ErrorReply`` (see :func:`error_reply`)."""
        where = f"the {self._server.name} server failed on {self.op} (request {self.rid})"
        self.reply(error_reply(exc, where, self.rid))


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
        unit_shm: Callable[[], list[str]] = lambda: [],
        shm: str = "",
        inproc: bool = False,
        on_disconnect: Callable[[bytes], None] | None = None,
        keys: Keys | None = None,
        cluster: str = "",
        controller: str = "",
        boot: str = "",
        journal: Any = None,
    ) -> None:
        """``inproc``: also bind an ``inproc://`` endpoint (``inproc_address``) for clients in this
        process that share ``ctx``; they skip TCP and libzmq's I/O thread. ``on_disconnect(peer)``
        is called, on the serving loop, when a TCP peer that sent a request disconnects. ``keys``:
        the TCP endpoint serves only the cluster's CURVE clients (:mod:`tqstream.protocol.auth`);
        the inproc one, reachable from this process only, has no handshake. ``journal``: a
        controller's :class:`~tqstream.controller.journal.Journal`; no reply leaves before the
        records appended until it was sent are durable (see :meth:`_release`)."""
        self.name = name
        self.max_message_bytes = max_message_bytes
        self._handler = handler
        self._units = units
        self._inproc_units = inproc_units
        self._unit_shm = unit_shm
        self._shm = shm
        self._cluster = cluster  # told to every client at the handshake (see Welcome.cluster)
        self._controller = controller  # a unit's controller, told likewise (Welcome.controller)
        self._boot = boot  # a unit's process, told likewise (Welcome.boot)
        self._journal = journal
        self._held: list[list[Any]] = []  # replies of this turn, waiting for its records
        self._waiting: collections.deque[tuple[Any, list[list[Any]]]] = collections.deque()
        self._release_soon = False
        self.inproc_address = ""
        self._closed = False
        self._failure: BaseException | None = None
        self._done: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ctx, self._keys = ctx, keys
        if keys is not None:
            auth.admit(ctx, keys)  # before the bind: no handshake may come first
        sock = _socket(ctx, zmq.ROUTER)
        try:
            if keys is not None:
                auth.serve_securely(sock, keys)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a vanished peer is dropped
            # a client's connection keeps its routing id when it reconnects (session_of): the new
            # TCP connection takes over from the old one the server may not have seen drop yet
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
            if keys is not None:
                auth.release(ctx, keys)
            raise OSError(
                exc.errno, f"the {name} server cannot bind tcp://{host}:{port}: {exc.strerror}"
            ) from exc
        self._sock = sock
        self._fd = _fd(sock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._on_disconnect = on_disconnect
        self._peer_fd: dict[bytes, int] = {}
        self._fd_peers: dict[int, set[bytes]] = {}
        self._sessions: dict[bytes, bytes] = {}  # connection -> the session its Hello named
        self._members: dict[bytes, int] = {}  # session -> its connections not yet dropped
        self.observe: Callable[[str, float, Any], None] | None = None
        """Called with (operation, perf_counter at arrival, reply) after each answer (metrics)."""
        self._monitor: zmq.Socket[Any] | None = None
        if on_disconnect is not None:
            endpoint = f"inproc://tqstream-peers-{next(_ENDPOINTS)}"
            sock.monitor(endpoint, zmq.EVENT_DISCONNECTED)
            self._monitor = _socket(ctx, zmq.PAIR)
            self._monitor.connect(endpoint)

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
        if self._monitor is not None:
            loop.add_reader(_fd(self._monitor), self._watch_peers)
        try:
            await asyncio.shield(self._done)
        finally:
            self._stop_reading()
        if self._failure is not None:
            raise self._failure

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._sock.closed:
            self._loop.remove_reader(self._fd)
            if self._monitor is not None:
                self._loop.remove_reader(_fd(self._monitor))

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
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._keys is not None:
            auth.release(self._ctx, self._keys)
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def sessions(self) -> int:
        """Peers (sessions, or connections that named none) with a TCP connection up."""
        return len({self._sessions.get(i, i) for i, fd in self._peer_fd.items() if fd >= 0})

    def connected(self, peer: bytes) -> bool:
        """Whether ``peer`` (a session, or a connection that named none) has a connection up,
        as far as its messages told: a peer is known from its first message on."""
        self._watch_peers()
        return peer in self._members or self._peer_fd.get(peer, -1) >= 0

    # --- peers ---
    def _track(self, identity: bytes, frame: zmq.Frame) -> None:
        """Learn the descriptor of a peer's first message. Disconnects queued before it are
        handled first: a new connection may reuse the descriptor of one that just dropped."""
        self._watch_peers()
        fd = -1
        with contextlib.suppress(zmq.ZMQError):
            fd = frame.get(zmq.SRCFD)
        self._peer_fd[identity] = fd
        if fd >= 0:  # inproc peers have none (they live and die with this process)
            self._fd_peers.setdefault(fd, set()).add(identity)
            session = session_of(identity)
            if session is not None and identity not in self._sessions:
                self._sessions[identity] = session
                self._members[session] = self._members.get(session, 0) + 1

    def _watch_peers(self) -> None:
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return
        while _events(monitor) & POLLIN:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for identity in self._fd_peers.pop(int(event["value"]), ()):
                self._peer_fd.pop(identity, None)
                peer = self._sessions.pop(identity, identity)
                if peer != identity:
                    self._members[peer] -= 1
                    if self._members[peer]:
                        continue  # the client's other connections live on
                    del self._members[peer]
                if not self._closed and self._on_disconnect is not None:
                    try:
                        self._on_disconnect(peer)
                    except Exception as exc:  # the owner's bug: end serve() with it
                        self._fatal(exc)

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
        if self._held:
            self._release()

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        """Handle one message; whatever goes wrong becomes an ``ErrorReply`` to its sender."""
        identity, payload = frames[0].bytes, frames[1:]
        if self._monitor is not None and identity not in self._peer_fd:
            self._track(identity, frames[-1])
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
                tracked = self._peer_fd.get(identity, -1) >= 0  # a TCP connection, watched
                if msg.session and tracked and identity not in self._sessions:
                    self._sessions[identity] = msg.session
                    self._members[msg.session] = self._members.get(msg.session, 0) + 1
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
            unit_shm=list(self._unit_shm()),
            cluster=self._cluster,
            controller=self._controller,
            durable=self._journal is not None,
            boot=self._boot,
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
        if isinstance(exc, TQStreamError):  # the peer's mistake or a fault it is told about
            _log.debug(
                "%s server: %s (request %d) from peer %s: %s: %s",
                self.name, responder.op, responder.rid, _short(responder.peer),
                type(exc).__name__, exc,
            )  # fmt: skip
        else:
            _log.error(
                "the %s server failed on %s (request %d) from peer %s; the peer gets an "
                "InternalError",
                self.name, responder.op, responder.rid, _short(responder.peer), exc_info=exc,
            )  # fmt: skip
        try:
            responder.fail(exc)
        except Exception as bug:
            self._fatal(bug)

    def _fatal(self, exc: BaseException) -> None:
        if self._failure is None:
            _log.error("the %s server at %s stops: %r", self.name, self.address, exc, exc_info=exc)
            self._failure = exc
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _send(self, identity: bytes, msg: Any, buffers: Sequence[Any]) -> None:
        if self._closed:
            return
        frames = [identity, encode(msg), *buffers]
        journal = self._journal
        if journal is not None and (self._held or self._waiting or journal.pending):
            self._held.append(frames)  # it may tell of a change not durable yet
            if not self._draining and not self._release_soon and self._loop is not None:
                self._release_soon = True
                self._loop.call_soon(self._release)
            return
        self._out(frames)

    def _out(self, frames: list[Any]) -> None:
        # copy=False: pyzmq still copies frames under COPY_THRESHOLD. With SNDHWM 0
        # a ROUTER send never blocks; what goes wrong (a buffer that is not a buffer) raises here,
        # to the code that answered.
        self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        # a send may consume the fd's edge: if input is waiting, the fd will not say so again
        # (inside _drain, its loop looks again anyway)
        if self._loop is not None and not self._draining and _events(self._sock) & POLLIN:
            self._loop.call_soon(self._drain)

    def _release(self) -> None:
        """Write the journal's records of this turn (one write for every request the drain
        handled) and send the replies held meanwhile once they are durable, in order."""
        self._release_soon = False
        if not self._held or self._closed:
            return
        self._journal.flush()
        wait = self._journal.durable()
        batch, self._held = self._held, []
        self._waiting.append((wait, batch))
        if wait is not None:
            wait.add_done_callback(lambda _: self._pump())
        self._pump()

    def _pump(self) -> None:
        while self._waiting and not self._closed:
            wait, batch = self._waiting[0]
            if wait is not None and not wait.done():
                return
            self._waiting.popleft()
            for frames in batch:
                self._out(frames)


def _short(peer: bytes) -> str:
    """A peer's identity or session, short enough for a log line."""
    return peer.hex()[:12]
