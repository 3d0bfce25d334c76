"""Files of checkpoints: durable writes, and a named thread to do file work off the event loop.

A checkpoint is written by several processes (the controller and every storage unit) into one
directory; each fsyncs what it wrote (files, then their directory) before it answers, so once the
controller renames the finished directory into place, everything in it is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["fsync_dir", "in_thread", "write_durably"]

T = TypeVar("T")


def write_durably(path: str, parts: Iterable[Any]) -> int:
    """Write the buffers of ``parts`` to the new file ``path`` and fsync it; returns its size."""
    n = 0
    with open(path, "xb") as f:
        for part in parts:
            n += f.write(part)
        f.flush()
        os.fsync(f.fileno())
    return n


def fsync_dir(path: str) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def in_thread(name: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own (named ``name``), awaited on the running loop.

    One thread per call, not a pool: checkpoints are rare and long, and a thread that outlives a
    cancelled caller (the server closing) finishes its file work and goes, holding nothing of the
    loop. Its result or exception comes back to the caller."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting caller
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
