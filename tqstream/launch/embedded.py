"""The embedded deployment: a controller and storage units inside the user's process.

They run on one named daemon thread with its own asyncio loop and ZMQ context, bound to loopback, so
the client talks to them over the same sockets and protocol as to a real cluster; ``close()`` (or
the client's ``close()``) stops them and frees their ports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any

import zmq

from tqstream.client.loop import LoopThread
from tqstream.config import ClientConfig, ControllerConfig, StorageConfig, from_env
from tqstream.controller.service import ControllerService
from tqstream.protocol.auth import ensure_keys
from tqstream.protocol.transport import context
from tqstream.storage.service import StorageService

__all__ = ["EmbeddedCluster", "init"]

_log = logging.getLogger("tqstream")


class EmbeddedCluster:
    def __init__(
        self, controller: ControllerConfig, storage: StorageConfig, storage_units: int = 1
    ) -> None:
        self._io = LoopThread(name="tqstream-embedded")
        self._lock = threading.Lock()
        self._closed = False
        self._tasks: list[asyncio.Task[Any]] = []
        self.failure: BaseException | None = None
        try:
            self._io.run(self._start(controller, storage, storage_units))
        except BaseException:
            self.close()
            raise

    async def _start(self, cc: ControllerConfig, sc: StorageConfig, n: int) -> None:
        self._ctx = context()
        loop = asyncio.get_running_loop()
        self.controller = ControllerService(cc, self._ctx, inproc=True)
        self.units: list[StorageService] = []
        self._watch(loop.create_task(self.controller.serve(), name="tqstream-controller"))
        link = self.controller.server.inproc_address or self.controller.address
        for i in range(n):
            unit = StorageService(sc, link, self._ctx, inproc=True)
            self.units.append(unit)
            self._watch(loop.create_task(unit.serve(), name=f"tqstream-storage-{i}"))
            await unit.register()

    def _watch(self, task: asyncio.Task[Any]) -> None:
        """A server loop that dies takes the whole cluster down, so every client request fails
        promptly with ConnectionLostError instead of waiting for a server that no longer reads."""
        self._tasks.append(task)

        def done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None and self.failure is None:
                self.failure = t.exception()
                _log.error(
                    "tqstream embedded server %s failed; stopping the embedded cluster",
                    t.get_name(),
                    exc_info=self.failure,
                )
                asyncio.get_running_loop().create_task(self._stop_servers())

        task.add_done_callback(done)

    @property
    def address(self) -> str:
        return self.controller.address

    @property
    def context(self) -> zmq.Context[Any]:
        """The servers' ZMQ context; clients in this process share it to use inproc://."""
        return self._ctx

    @property
    def io(self) -> LoopThread:
        """The loop thread the servers run on."""
        return self._io

    def close(self) -> None:
        """Stop the servers and free their ports. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._io.run(self._stop())
        finally:
            self._io.stop()

    async def _stop_servers(self) -> None:
        for unit in getattr(self, "units", []):
            await unit.close()
        if hasattr(self, "controller"):
            await self.controller.close()

    async def _stop(self) -> None:
        await self._stop_servers()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "_ctx"):
            self._ctx.destroy(linger=0)


def init(
    *,
    storage_units: int = 1,
    lease_timeout: float | None = None,
    put_timeout: float | None = None,
    max_message_bytes: int | None = None,
    storage_max_bytes: int | None = None,
    replicas: int | None = None,
    keys: str | None = None,
    metrics_port: int | None = None,
    client_config: ClientConfig | None = None,
    max_rows: int | None = None,
) -> Any:
    """Start an embedded controller and ``storage_units`` storage units; return a client.

    ``storage_max_bytes``: byte quota per storage unit (puts wait for room, then raise
    CapacityError). ``replicas``: copies of each row (2 needs ``storage_units >= 2``; see
    ``ControllerConfig.replicas``). ``keys``: path of a CURVE key file, made if missing; the
    servers' TCP address (``client.address``, for other processes) then serves only peers holding
    it, while this client reaches them in-process, where no handshake applies. Closing the client
    stops them. ``metrics_port``: serve Prometheus metrics at ``http://127.0.0.1:PORT/metrics``
    (docs/observability.md). ``max_rows``: rows the cluster holds at most (puts beyond raise
    CapacityError). Settings left as None come from ``TQSTREAM_*`` environment
    variables or the defaults in :mod:`tqstream.config`.
    """
    from tqstream.client.client import Client

    cc = from_env(
        ControllerConfig,
        lease_timeout=lease_timeout,
        put_timeout=put_timeout,
        max_message_bytes=max_message_bytes,
        replicas=replicas,
        host="127.0.0.1",
        port=0,
        keys=keys,
        metrics_port=metrics_port,
        max_rows=max_rows,
    )
    if cc.keys:
        ensure_keys(cc.keys)  # made here, once: the servers only load it
    sc = from_env(
        StorageConfig,
        max_message_bytes=max_message_bytes,
        max_bytes=storage_max_bytes,
        host="127.0.0.1",
        port=0,
        keys=cc.keys,
    )
    config = client_config or from_env(ClientConfig)
    if cc.keys and not config.keys:  # what this client's config hands on to other processes
        config = dataclasses.replace(config, keys=cc.keys)
    cluster = EmbeddedCluster(cc, sc, storage_units)
    try:
        # the client shares the servers' loop thread: a request and its answer then run on one
        # thread, with no hand-over of the GIL between the client's and the servers' threads
        return Client(
            cluster.address,
            config,
            inproc_address=cluster.controller.server.inproc_address,
            on_close=cluster.close,
            io=cluster.io,
            context=cluster.context,
        )
    except BaseException:
        cluster.close()
        raise
