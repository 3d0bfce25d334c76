"""A process holding many idle tqstream clients, for the many-clients scenario (test_clients.py).

``python -m benchmarks._idle_clients ADDRESS COUNT PARK``: opens COUNT clients of the controller at
ADDRESS, one after the other, on one loop thread and one ZMQ context (as the many workers of one
host each hold a client of their own); then PARK of them each ask for one row of the partition
``idle``, which nobody writes, with no timeout: gets the controller parks. Prints one JSON line
(the connect times, in seconds) once every get is sent, then holds its clients until its standard
input closes, and closes them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


def main(address: str, count: int, park: int) -> None:
    import zmq

    from tqstream import Client  # imports torch and tensordict: before the connect times
    from tqstream.client.loop import LoopThread

    io = LoopThread(name="idle-clients")
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.max_sockets = 4 * count + 64  # ZMQ's default, 1023, is less than one host's clients
    clients: list[Client] = []
    connect: list[float] = []
    gets: list[Any] = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            clients.append(Client(address, io=io, context=ctx))
            connect.append(time.perf_counter() - t0)
        gets = [
            io.submit(c.async_get_meta("idle", ["x"], 1, "t", timeout=None)) for c in clients[:park]
        ]
        print(json.dumps({"connect": connect}), flush=True)
        sys.stdin.read()
    finally:
        for get in gets:
            get.cancel()
        io.run(asyncio.sleep(0.1))  # the cancellations reach the loop before the sockets close
        for c in clients:
            c.close()
        io.stop()
        ctx.destroy(linger=0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
