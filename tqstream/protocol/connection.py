"""The client side of the transport: one DEALER socket per connection to a server.

A client never waits forever on a dead server: ZMQ would silently reconnect and the reply would be
lost, so a monitor fails every pending request with ``ConnectionLostError`` when the TCP connection
drops (heartbeats turn a silent peer into a drop), and a request made while the connection is down
waits at most ``connect_timeout`` for ZMQ to reconnect. Everything runs on the caller's asyncio
loop; a request made while that loop is current but not running (a sync call on a client lane)
waits for its reply by polling its sockets on the calling thread, with the same deadlines and link
checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from tqstream.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    ConnectionLostError,
    ControllerUnavailableError,
    InternalError,
    MalformedMessageError,
    MessageTooLargeError,
    RequestTimeoutError,
    TQStreamError,
)
from tqstream.protocol import auth
from tqstream.protocol.auth import Keys
from tqstream.protocol.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Welcome,
    check_request,
    decode_reply,
    encode,
)
from tqstream.protocol.transport import (
    _ENDPOINTS,
    POLLIN,
    POLLOUT,
    RIDS,
    _events,
    _fd,
    _nbytes,
    _op,
    _peek,
    _rid_of,
    _socket,
    _version_error,
    error_from_reply,
    routing_id,
)

__all__ = ["Connection", "another_cluster", "not_a_controller"]


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
        keys: Keys | None = None,
        session: bytes = b"",
    ) -> None:
        self.address, self.role = address, role
        self.max_message_bytes = max_message_bytes
        self._limit = max_message_bytes  # min(ours, the server's) once welcomed
        self._connect_timeout = connect_timeout
        self._session = session or os.urandom(16)
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self.resend = False
        """Send the requests in flight again when the connection is back after a drop, instead of
        failing them (a controller with a journal answers each once: ``Welcome.durable``)."""
        self.reconnect_timeout = 60.0
        """With ``resend``: seconds the requests wait for the server to come back."""
        self._sent: dict[int, list[Any]] = {}  # with resend: the frames of each request in flight
        self._outage: asyncio.TimerHandle | None = None
        self._down_since = 0.0
        self._hello = 0  # the rid of the handshake sent again after a reconnect
        self._refusals = 0  # handshakes that failed
        self._grace: dict[int, asyncio.TimerHandle] = {}  # requests sent while the link is down
        self._down = False
        self._ever_up = False
        self._closed = False
        self._broken: BaseException | None = None
        self._refused: str | None = None  # why the last handshake failed
        self._keys = keys
        self._unsent: list[list[Any]] = []  # requests ZMQ would not take yet (never with HWM 0)
        self._poller: zmq.Poller | None = None  # for requests that wait without a running loop
        self.decode: Callable[[Any], Any] = decode_reply  # how replies are read
        self.on_down: Callable[[], None] | None = None
        """Called when the TCP connection drops (the peer died, or missed 3 heartbeats)."""
        self.on_up: Callable[[], None] | None = None
        """Called when the connection is back after a drop (the same or a restarted peer)."""
        self.wake: int | None = None
        """A file descriptor that, once readable, ends a request waiting without a running loop
        with ``ClosedError`` (another thread closes the client: ``lanes.py``)."""
        # inproc passes buffers by pointer: copy what we send and what we receive, so neither
        # side's tensors alias the other's memory (what a socket between processes does anyway)
        self._inproc = address.startswith("inproc://")
        sock = _socket(ctx, zmq.DEALER)
        ivl = max(1, round(heartbeat_interval * 1000))
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_MONITOR_STOPPED
        events |= _HANDSHAKE_FAILED
        try:
            if keys is not None and not self._inproc:  # inproc has no handshake (auth.py)
                auth.connect_securely(sock, keys)
            sock.setsockopt(zmq.LINGER, 0)
            # the same id on every reconnect: it names this client's session (server.py)
            sock.setsockopt(zmq.ROUTING_ID, routing_id(self._session, next(_CONNECTIONS)))
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
        session: bytes = b"",
        connect_timeout: float,
        heartbeat_interval: float,
        max_message_bytes: int,
        keys: Keys | None = None,
    ) -> Connection:
        """Connect and handshake (``Hello`` → ``Welcome``) within ``connect_timeout``; never hangs,
        and closes the socket on any failure. ``keys``: be a CURVE client of the cluster (a TCP
        address only). A failed ZMQ handshake (keys missing or not the server's) raises
        ``AuthenticationError`` at once."""
        conn = cls(ctx, address, role, connect_timeout, heartbeat_interval, max_message_bytes, keys,
                   session)  # fmt: skip
        try:
            hello = Hello(rid=0, protocol=PROTOCOL_VERSION, role=role, session=session)
            conn.resend = True  # a server that restarts meanwhile gets the hello again
            conn.reconnect_timeout = connect_timeout
            try:
                reply, _ = await conn.request(hello, timeout=connect_timeout)
            except (RequestTimeoutError, ConnectionLostError):
                if conn._refused is not None:  # the handshake failed, maybe for want of keys
                    raise AuthenticationError(conn._refused, address=address) from None
                raise ConnectError(
                    f"no tqstream server answered at {address} within {connect_timeout}s; check "
                    f"the address and that the server (tqstream-launch or tqstream.init) is "
                    f"running",
                    address=address,
                    timeout=connect_timeout,
                ) from None
            finally:
                conn.resend = False
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
        rid = next(RIDS)
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
            if self._down and not self.resend:  # queued until ZMQ reconnects: at most that long
                self._grace[rid] = loop.call_later(self._connect_timeout, self._unreachable, rid)
            # a timer, not asyncio.wait_for: no extra task per request
            timer = None if timeout is None else loop.call_later(timeout, _expire, fut)
        try:
            frames = [header, *buffers]
            if self.resend:
                self._sent[rid] = frames
            if not (self.resend and self._down):  # else sent once the server is back
                self._send(frames)
            reply, frames = self._wait(fut, rid, timeout) if waits_here else await fut
        except _Expired:
            if self.resend and self._down:  # not the server's slowness: it is away
                raise ControllerUnavailableError(
                    f"no reply to {op} (request {rid}) within {timeout}s: the server at "
                    f"{self.address} went away and is not back yet; a controller with a journal "
                    f"is restarted by its deployment (tqstream-launch, tqstream.ray): retry",
                    op=op,
                    address=self.address,
                    timeout=timeout,
                ) from None
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
            self._sent.pop(rid, None)
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
        grace = self._grace_end(now) if self._down else None
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
            if grace is None and self._down and self.resend:
                grace = self._grace_end(now)  # dropped while waiting: the requests wait
            if grace is not None and not self._down:
                grace = None  # reconnected
            elif grace is not None and now >= grace:
                if self.resend:
                    self._gone()
                else:
                    self._unreachable(rid)
            elif deadline is not None and now >= deadline:
                raise _Expired
        return fut.result()

    def _grace_end(self, now: float) -> float:
        if self.resend:
            return (self._down_since or now) + self.reconnect_timeout
        return now + self._connect_timeout

    def close(self) -> None:
        """Fail pending requests with ``ClosedError``, stop watching, close the sockets.
        Idempotent; call on the connection's loop thread (or while nothing else uses it)."""
        if self._closed:
            return
        self._closed = True
        if self._outage is not None:
            self._outage.cancel()
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

    @property
    def down(self) -> bool:
        """The connection dropped and is not back yet."""
        return self._down

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
                reply = self.decode(header)
            except Exception as exc:
                rid = _rid_of(_peek(header))
                fut, op = self._pending.get(rid, (None, ""))
                if fut is not None and not fut.done():
                    text = f"the reply from {self.address} to {op} (request {rid}) is not a "
                    text += f"tqstream protocol {PROTOCOL_VERSION} reply: {exc}"
                    fut.set_exception(MalformedMessageError(text))
                continue  # without a known rid nobody waits for it
            if reply.rid == self._hello and self._hello:
                self._welcomed_again(reply)
                continue
            entry = self._pending.get(reply.rid)
            if entry is not None and not entry[0].done():  # else: late (timed out) or unknown
                if self._inproc and len(frames) > 1:  # they may alias the server's memory
                    frames[1:] = [bytearray(f.buffer) for f in frames[1:]]
                entry[0].set_result((reply, frames))

    def _watch(self) -> None:
        while _events(self._monitor) & POLLIN:
            parsed = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            event = parsed["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event & _HANDSHAKE_FAILED:  # ZMQ retries by itself; the requests would wait
                self._refused = self._refusal(int(event), int(parsed["value"]))
                self._refusals += 1
                if _certain(int(event), int(parsed["value"])):
                    self._fail_all(AuthenticationError, _literal(self._refused))
                # else the disconnect that follows fails them as lost: a peer that died in the
                # handshake looks the same as one that refused (open() and _unreachable tell)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                was_down, self._down, self._ever_up = self._down, False, True
                self._refused = None
                for grace in self._grace.values():
                    grace.cancel()
                self._grace.clear()
                if was_down and self.resend:
                    self._send_again()
                if was_down and self.on_up is not None:
                    self.on_up()
            elif event == zmq.EVENT_DISCONNECTED:  # the pending replies died with the connection
                was_down, self._down = self._down, True
                # sent again once the server is back; but handshakes that failed twice before
                # the first welcome are a refusal (keys), not a server that died in one: they fail
                opening_refused = self._refusals > 1 and not hasattr(self, "welcome")
                if self.resend and not opening_refused:
                    if not was_down:
                        self._down_since = time.monotonic()
                        if self._loop.is_running() and self._outage is None:
                            self._outage = self._loop.call_later(self.reconnect_timeout,
                                                                 self._gone)  # fmt: skip
                else:
                    self._fail_all(ConnectionLostError, _LOST)
                if self._ever_up and self.on_down is not None:
                    self.on_down()

    def _refusal(self, event: int, value: int) -> str:
        """Why a ZMQ handshake failed, saying whose keys disagree with whose. Which side notices
        first is a race (a refused peer may see only its connection reset), so only the events
        that cannot be anything else are named precisely."""
        where = f"the ZMQ handshake with the server at {self.address} failed"
        theirs = "its cluster's key file"
        if self._keys is None:
            text = (
                f"{where}: the server requires CURVE keys and this {self.role} has none (or no "
                f"tqstream server listens there); pass ClientConfig(keys=PATH) or set "
                f"TQSTREAM_KEYS=PATH, PATH being {theirs} (the one tqstream-launch --keys or "
                f"tqstream.init(keys=...) made)"
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
            text = (
                f"{where}: this {self.role} uses the CURVE keys in {self._keys.path} but the "
                f"server has no keys (it was started without --keys, or with --insecure); connect "
                f"without keys, or restart the cluster with them"
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            text = (
                f"{where}: the server refused this {self.role}'s client key from "
                f"{self._keys.path} (status {value}); use {theirs}"
            )
        else:  # most often the server could not decrypt our hello: not its public key
            text = (
                f"{where}: the server's public key is not the one in {self._keys.path} (the file "
                f"of another cluster, or of an earlier launch?), or the server has no keys, or no "
                f"tqstream server listens there; use {theirs}"
            )
        return text

    def _send_again(self) -> None:
        """The server is back: shake hands again (is it still the cluster it was?), then send
        every request in flight again, in order (the server answers each once)."""
        if self._outage is not None:
            self._outage.cancel()
            self._outage = None
        self._down_since = 0.0
        self._hello = next(RIDS)
        hello = Hello(
            rid=self._hello, protocol=PROTOCOL_VERSION, role=self.role, session=self._session
        )
        self._send([encode(hello)])
        for rid in sorted(self._sent):
            self._send(self._sent[rid])

    def _welcomed_again(self, reply: Any) -> None:
        self._hello = 0
        mine = getattr(self, "welcome", None)
        if mine is None or not isinstance(reply, Welcome) or reply.cluster == mine.cluster:
            return
        self._fail_all(
            ControllerUnavailableError,
            _literal(another_cluster(self.address, reply.cluster, mine.cluster).message),
        )

    def _gone(self) -> None:
        """With ``resend``: the server did not come back within ``reconnect_timeout``."""
        self._outage = None
        if not self._down:
            return
        text = _GONE.replace("{t}", str(self.reconnect_timeout))
        self._fail_all(ControllerUnavailableError, text)

    def _unreachable(self, rid: int) -> None:
        self._grace.pop(rid, None)
        if self._down and self._refused is not None:
            self._fail_all(AuthenticationError, _literal(self._refused), only=rid)
        elif self._down:
            self._fail_all(ConnectionLostError, _DOWN, only=rid)

    def _fail_all(self, cls: type[TQStreamError], text: str, only: int | None = None) -> None:
        for rid, (fut, op) in list(self._pending.items()):
            # a future of a closed loop has nobody waiting (and cannot take a result any more)
            if not fut.done() and only in (None, rid) and not fut.get_loop().is_closed():
                what, timeout = f"{op} (request {rid})", self._connect_timeout
                message = text.format(address=self.address, what=what, timeout=timeout)
                fut.set_exception(cls(message, address=self.address, op=op, rid=rid))


_HANDSHAKE_FAILED = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MECHANISM_MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)


def _literal(text: str) -> str:
    """``text`` as a ``_fail_all`` format string that formats to itself."""
    return text.replace("{", "{{").replace("}", "}}")


def _certain(event: int, value: int) -> bool:
    """Whether a handshake failure can only be about keys: the server refused the client's key,
    or one side has keys and the other none."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return True
    return event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH


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
_GONE = (
    "the server at {address} went away and did not come back within {t}s (reconnect_timeout) to "
    "answer {what}; a controller with a journal is restarted by its deployment (tqstream-launch, "
    "tqstream.ray): check that it runs"
)
_CONNECTIONS = itertools.count()
_DOWN = (
    "connection to {address} is down and no server came back within {timeout}s (connect_timeout) "
    "to answer {what}; the server may have died: retry once it is back (the connection reconnects "
    "by itself)"
)


def another_cluster(address: str, theirs: str, mine: str) -> ControllerUnavailableError:
    """What a client's requests meet at a controller of another cluster than it reached first
    (one restarted without its journal)."""
    return ControllerUnavailableError(
        f"the server at {address} is another cluster now ({theirs!r}, not {mine!r}): it was "
        f"restarted without its journal, so what this client did there and the requests in "
        f"flight are not known; connect a new client",
        address=address,
        cluster=theirs,
        expected=mine,
    )


def not_a_controller(address: str, welcome: Welcome) -> ConnectError:
    """What connecting a client to a server that is not a controller raises."""
    if welcome.server == "storage":
        where = f"of the cluster at {welcome.controller}" if welcome.controller else "(embedded)"
        return ConnectError(
            f"{address} is a storage unit {where}, not a controller; connect to the controller's "
            f"address (the one tqstream-launch prints as 'tqstream ready at ...'; clients find "
            f"the units through it)",
            address=address,
            controller=welcome.controller,
        )
    return ConnectError(
        f"{address} is a tqstream {welcome.server!r} server, not a controller; connect to the "
        f"controller's address",
        address=address,
    )
