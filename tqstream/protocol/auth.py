"""CURVE keys for a cluster: who may talk to its servers over TCP, encrypted.

A cluster has one key file: a JSON object, mode 0600, with two CURVE keypairs (Z85 text). The
*server* keypair belongs to every controller and storage unit of the cluster; the *client* keypair
to everyone who may talk to them: clients, and the servers themselves when they connect to each
other (a unit registering with the controller, the controller reaching a unit). Holding the file
is membership of the cluster.

A server's ROUTER is a CURVE server with the server secret key, and a ZAP handler (RFC 27) in its
ZMQ context admits only the cluster's client public key. A connection is a CURVE client with the
server public key and the client keypair. A peer without the keys never gets past the ZMQ
handshake: no message of it reaches a server's handler, and what it sent is dropped unread.

``inproc://`` endpoints (the embedded servers and their own client, in one process) carry no
handshake at all: libzmq applies no security mechanism to them, and only code in the same process,
which can read the key file anyway, can reach them.

The ZAP handler is written here rather than taken from ``zmq.auth``: its socket is one this package
owns (a forked child must never close it, :func:`tqstream.protocol.transport._disown`) and its
thread stops when the last server of its context closes.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import threading
import time
from typing import Any

import zmq
from zmq.utils import z85

from tqstream.errors import KeyFileError
from tqstream.protocol.transport import POLLIN, _events, _socket

__all__ = [
    "Keys",
    "admit",
    "connect_securely",
    "ensure_keys",
    "generate_keys",
    "load_keys",
    "release",
    "serve_securely",
]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a context's authentication requests (fixed by RFC 27)."""

_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


@dataclasses.dataclass(frozen=True, repr=False)
class Keys:
    """A cluster's two CURVE keypairs (Z85, 40 bytes each) and the file they came from."""

    path: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never the secrets
        return f"Keys({self.path!r})"


def generate_keys(path: str | os.PathLike[str]) -> Keys:
    """Write a new key file at ``path`` (mode 0600, only its owner reads it) and return its keys.
    Refuses to overwrite: a cluster's servers and clients must keep agreeing on one file."""
    path = os.fspath(path)
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    keys = Keys(path, server_public, server_secret, client_public, client_secret)
    text = json.dumps({"tqstream_keys": 1, **{f: getattr(keys, f).decode() for f in _FIELDS}})
    # written beside, then linked into place: a reader never sees half a file, and of two
    # processes creating the same file at once one wins and the other loads it (ensure_keys)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.link(tmp, path)
    except FileExistsError:
        raise KeyFileError(
            f"the key file {path} exists already; load it (tqstream.load_keys, or pass it as "
            f"keys=) or remove it to make new keys for every server and client",
            path=path,
        ) from None
    except OSError as exc:
        raise KeyFileError(f"cannot write the key file {path}: {exc}", path=path) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return keys


def load_keys(path: str | os.PathLike[str]) -> Keys:
    """The keys in the key file at ``path``; ``KeyFileError`` saying what is wrong with it."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise KeyFileError(
            f"cannot read the key file {path}: {exc.strerror}; a key file is made by "
            f"tqstream-launch --keys {path} or tqstream.generate_keys({path!r})",
            path=path,
        ) from exc
    try:
        value: Any = json.loads(text)
        if not isinstance(value, dict) or value.get("tqstream_keys") != 1:
            raise ValueError("not a tqstream key file (no tqstream_keys: 1)")
        keys = Keys(path, *(_key(value, f) for f in _FIELDS))
        for kind in ("server", "client"):
            secret = getattr(keys, f"{kind}_secret")
            if zmq.curve_public(secret) != getattr(keys, f"{kind}_public"):
                raise ValueError(f"{kind}_public is not the public key of {kind}_secret")
    except ValueError as exc:
        raise KeyFileError(
            f"the key file {path} is not a valid tqstream key file: {exc}", path=path
        ) from None
    return keys


def ensure_keys(path: str | os.PathLike[str]) -> Keys:
    """The keys at ``path``, made first if the file does not exist (what a launcher does)."""
    if not os.path.exists(path):
        try:
            return generate_keys(path)
        except KeyFileError:
            if not os.path.exists(path):
                raise  # not a race with another creator: a real failure
    return load_keys(path)


def _key(value: dict[str, Any], name: str) -> bytes:
    text = value.get(name)
    if not isinstance(text, str) or len(text) != 40:
        raise ValueError(f"{name} must be a CURVE key as 40 characters of Z85 text")
    try:
        z85.decode(text)
    except Exception:
        raise ValueError(f"{name} is not Z85 text") from None
    return text.encode()


def serve_securely(sock: zmq.Socket[Any], keys: Keys) -> None:
    """Make ``sock`` (not bound yet) a CURVE server; :func:`admit` its clients first."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)


def connect_securely(sock: zmq.Socket[Any], keys: Keys) -> None:
    """Make ``sock`` (not connected yet) a CURVE client of the cluster's servers."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


# --- the ZAP handler: one per ZMQ context, shared by the servers in it ---
class _Gate:
    """Answers libzmq's authentication requests for one context on a thread of its own: a CURVE
    handshake whose client key is one of ``allowed`` passes, any other fails (status 400)."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.allowed: dict[bytes, int] = {}  # raw client public key -> servers admitting it
        sock = _socket(ctx, zmq.REP)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            _bind(sock)
        except zmq.ZMQError as exc:  # reported like a server's own bind failing
            sock.close(linger=0)
            raise OSError(
                exc.errno,
                f"cannot bind the authentication handler of this ZMQ context at {ZAP_ENDPOINT}: "
                f"{exc.strerror} (another ZAP handler, e.g. zmq.auth's, is bound there); give "
                f"tqstream's servers a ZMQ context of their own",
            ) from exc
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="tqstream-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while self._wake_r not in dict(poller.poll()):
            while _events(self._sock) & POLLIN:
                request = self._sock.recv_multipart(zmq.NOBLOCK)
                self._sock.send_multipart(self._answer(request), zmq.NOBLOCK)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, routing id, mechanism, credentials...
        request_id = request[1] if len(request) > 1 else b""
        if len(request) < 6:  # libzmq never sends one; answered so the REP socket goes on
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        mechanism, credentials = request[5], request[6:]
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        if any(hmac.compare_digest(key, k) for k in list(self.allowed)):
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        return [b"1.0", request_id, b"400", b"not a client key of this cluster", b"", b""]

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join()
        self._sock.close(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _bind(sock: zmq.Socket[Any], patience: float = 1.0) -> None:
    """Bind the ZAP endpoint. libzmq releases a closed socket's inproc endpoint asynchronously,
    so right after the previous gate of the context closed it may still be taken for a moment."""
    deadline = time.monotonic() + patience
    while True:
        try:
            sock.bind(ZAP_ENDPOINT)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


_GATES: dict[zmq.Context[Any], _Gate] = {}
_LOCK = threading.Lock()


def _forget_gates() -> None:
    """A forked child has none of the parent's gate threads (and its sockets are shadows)."""
    global _LOCK
    _GATES.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_gates)


def admit(ctx: zmq.Context[Any], keys: Keys) -> None:
    """Let the cluster's clients through the CURVE servers of ``ctx`` (before one binds: without
    a ZAP handler libzmq would admit any client that knows the server public key)."""
    raw = z85.decode(keys.client_public)
    with _LOCK:
        gate = _GATES.get(ctx)
        if gate is None:
            gate = _GATES[ctx] = _Gate(ctx)
        # replaced, never mutated: the gate's thread reads it without the lock
        gate.allowed = {**gate.allowed, raw: gate.allowed.get(raw, 0) + 1}


def release(ctx: zmq.Context[Any], keys: Keys) -> None:
    """Undo one :func:`admit`; the last one stops the context's ZAP handler."""
    raw = z85.decode(keys.client_public)
    with _LOCK:
        gate = _GATES.get(ctx)
        if gate is None or raw not in gate.allowed:
            return
        allowed = dict(gate.allowed)
        allowed[raw] -= 1
        if not allowed[raw]:
            del allowed[raw]
        gate.allowed = allowed
        if not allowed:
            del _GATES[ctx]
            gate.close()
