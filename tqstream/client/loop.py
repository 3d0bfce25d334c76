"""A named daemon thread running an asyncio loop, the single owner of a client's sockets.

ZMQ sockets are not thread-safe, so every socket of a client lives on this loop; sync calls block on
``run`` and async calls await a wrapped future, from any thread and any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_log = logging.getLogger("tqstream.loop")


def log_loop_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's report of an error nobody handled (an exception never retrieved, a failing
    callback), through the ``tqstream`` loggers instead of asyncio's."""
    _log.error("%s", context.get("message", "error on the event loop"),
               exc_info=context.get("exception"))  # fmt: skip


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(log_loop_errors)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait; a KeyboardInterrupt cancels it there."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a sync tqstream call was made from the client's own IO loop; "
                "use the async_ method instead"
            )
        fut = self.submit(coro)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=10)
