"""A raw pyzmq store process: the lower bound for moving tensors through a separate process.

``python _zmq_store.py ADDRESS`` binds a ROUTER socket, prints ``READY <endpoint>`` and serves:

- ``[b"put", key, header, *frames]`` keeps the frames (as received, no copy) under ``key``; ``ok``
- ``[b"get", key]`` sends ``[header, *frames]`` back (zero-copy resend of the held frames)
- ``[b"del", key]`` drops them; ``ok``
- ``[b"echo", *frames]`` sends the frames back (a metadata exchange with no work behind it)
- ``[b"len"]`` the number of keys held; ``[b"stop"]`` replies and exits
"""

from __future__ import annotations

import sys

import zmq


def serve(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    print("READY", sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    store: dict[bytes, list[zmq.Frame]] = {}
    while True:
        ident, op, *rest = sock.recv_multipart(copy=False)
        cmd = op.bytes
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
