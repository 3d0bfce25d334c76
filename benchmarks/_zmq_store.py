"""A raw pyzmq store process: the lower bound for moving tensors through a separate process.

``python _zmq_store.py ADDRESS`` binds a ROUTER socket, prints ``READY <endpoint>`` and serves:

- ``[b"put", key, header, *frames]`` keeps the frames (as received, no copy) under ``key``; ``ok``
- ``[b"get", key]`` sends ``[header, *frames]`` back (zero-copy resend of the held frames)
- ``[b"del", key]`` drops them; ``ok``
- ``[b"echo", *frames]`` sends the frames back (a metadata exchange with no work behind it)
- ``[b"putrows", key, rows, header, *frames]`` a put of ``rows`` rows (for ``take``); ``ok``
- ``[b"take", n]`` removes the oldest entries holding ``n`` rows and sends them back, each as its
  frame count then its frames (header first); answered once they are held (one take at a time)
- ``[b"len"]`` the number of keys held; ``[b"stop"]`` replies and exits
"""

from __future__ import annotations

import sys
from typing import Any

import zmq


def serve(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    print("READY", sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    store: dict[bytes, list[zmq.Frame]] = {}
    rows: dict[bytes, int] = {}  # rows of each putrows entry, in put order
    held = 0  # rows of those entries
    taking: tuple[zmq.Frame, int] | None = None  # a take waiting for rows
    while True:
        ident, op, *rest = sock.recv_multipart(copy=False)
        cmd = op.bytes
        if cmd == b"putrows":
            key = rest[0].bytes
            store[key], rows[key] = rest[2:], int(rest[1].bytes)
            held += rows[key]
            sock.send_multipart([ident, b"ok"])
        elif cmd == b"take":
            taking = (ident, int(rest[0].bytes))
        if taking is not None and held >= taking[1]:
            out: list[Any] = [taking[0]]
            taken = 0
            while taken < taking[1]:
                key = next(iter(rows))
                taken += rows.pop(key)
                frames = store.pop(key)
                out += [str(len(frames)).encode(), *frames]
            held -= taken
            sock.send_multipart(out, copy=False)
            taking = None
        if cmd in (b"putrows", b"take"):
            continue
        if cmd == b"put":
            store[rest[0].bytes] = rest[1:]
            sock.send_multipart([ident, b"ok"])
        elif cmd == b"get":
            sock.send_multipart([ident, *store[rest[0].bytes]], copy=False)
        elif cmd == b"echo":
            sock.send_multipart([ident, *rest])
        elif cmd == b"del":
            store.pop(rest[0].bytes, None)
            sock.send_multipart([ident, b"ok"])
        elif cmd == b"len":
            sock.send_multipart([ident, str(len(store)).encode()])
        elif cmd == b"stop":
            sock.send_multipart([ident, b"ok"])
            break
    sock.close()
    ctx.term()


if __name__ == "__main__":
    serve(sys.argv[1])
