"""ZMQ transport: what the server (:mod:`tqstream.protocol.server`) and the connection
(:mod:`tqstream.protocol.connection`) share — contexts, sockets, error replies.

Many requests share one socket: each request carries a fresh ``rid`` and its reply echoes it, so
replies may come back in any order (a parked ``get_meta`` is passed by later requests). Frame 0 of
a message is the msgpack header (:mod:`tqstream.protocol.messages`); frames 1..n are tensor buffers,
sent without copying from ``COPY_THRESHOLD`` (256 KiB) up and received as ``zmq.Frame``\\ s
whose memory the caller may keep (the storage unit stores received frames as they are).

Sockets are plain (blocking-API) ZMQ sockets driven by the loop directly: the loop watches each
socket's ZMQ file descriptor and, when it signals, drains every pending message with non-blocking
receives and handles it in the same callback; sends never block (``SNDHWM`` 0). That costs one loop
wake-up per burst of messages instead of a future and a task step per message, which is most of a
small request's latency.
"""

from __future__ import annotations

import itertools
import os
import weakref
from typing import Any

import msgspec
import zmq

from tqstream.errors import InternalError, ProtocolVersionError, TQStreamError, error_class
from tqstream.protocol.messages import PROTOCOL_VERSION, ErrorReply

__all__ = ["context", "error_from_reply", "error_reply", "shared_context"]

MiB = 1 << 20

_ENDPOINTS = itertools.count()
"""Numbers inproc endpoint names: ``id()`` values are reused, and libzmq releases a closed
socket's endpoint asynchronously, so a reused name could still be taken."""


COPY_THRESHOLD = 256 * 1024
"""Frames smaller than this are copied into the message when sent (pyzmq's default: 64 KiB).
A zero-copy send makes libzmq hand the buffer back through pyzmq's garbage-collector thread — a
thread wake-up and a GIL hand-over per frame, which costs more than copying a few hundred KiB."""


_OWNED: weakref.WeakSet[Any] = weakref.WeakSet()


_ROUTED = b"T"  # the first byte of a routing id that names its session (server ids start with 0)
_SESSION = 16
RIDS = itertools.count(1)
"""Request ids, one sequence for every connection of the process: with the session its
connection's routing id names, a request's ``rid`` names it at the server across reconnects (a
controller with a journal answers a request sent again as it did the first time)."""


def routing_id(session: bytes, n: int) -> bytes:
    """The routing id of a client's connection ``n``: it names the client's session."""
    return _ROUTED + session + n.to_bytes(4, "big")


def session_of(identity: bytes) -> bytes | None:
    """The session a connection's routing id names (None: one ZMQ made up)."""
    if len(identity) == 1 + _SESSION + 4 and identity[:1] == _ROUTED:
        return identity[1 : 1 + _SESSION]
    return None


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
