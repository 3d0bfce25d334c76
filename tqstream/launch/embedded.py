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
from tqstream.config import (
    ClientConfig,
    ClusterConfig,
    ControllerConfig,
    StorageConfig,
    cluster_config,
    from_env,
    is_loopback,
)
from tqstream.controller.service import ControllerService
from tqstream.errors import ConfigError
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
    config: ClusterConfig | None = None,
    client_config: ClientConfig | None = None,
    **settings: Any,
) -> Any:
    """Start an embedded controller and storage units in this process; return a client of them.

    ``config``: the cluster (:class:`tqstream.ClusterConfig`; None: the defaults, then the
    ``TQSTREAM_*`` environment variables); keyword ``settings`` change it by name, as every
    deployment takes them (docs/deployment.md lists them): ``storage_units`` (default 1),
    ``storage_max_bytes`` (byte quota per unit), ``replicas``, ``lease_timeout``, ``max_rows``,
    ``metrics_port`` (Prometheus at ``http://127.0.0.1:PORT/metrics``), ``keys``, ... The servers
    bind loopback (``host`` must be a loopback address). ``keys``: path of a CURVE key file, made
    if missing; the servers' TCP address (``client.address``, for other processes) then serves
    only peers holding it, while this client reaches them in-process, where no handshake applies.
    ``client_config``: the returned client's. Closing the client stops the servers.
    """
    from tqstream.client.client import Client

    cluster_cfg = cluster_config(config, **settings)
    cc = cluster_cfg.controller
    if not is_loopback(cc.host):
        raise ConfigError(
            f"host={cc.host!r}: the embedded cluster binds loopback only; to serve other machines "
            f"start it with tqstream-launch or tqstream.ray.launch",
            setting="host",
        )
    if cc.keys:
        ensure_keys(cc.keys)  # made here, once: the servers only load it
    client_cfg = client_config or from_env(ClientConfig)
    if cc.keys and not client_cfg.keys:  # what this client's config hands on to other processes
        client_cfg = dataclasses.replace(client_cfg, keys=cc.keys)
    cluster = EmbeddedCluster(cc, cluster_cfg.storage, cluster_cfg.storage_units or 1)
    try:
        # the client shares the servers' loop thread: a request and its answer then run on one
        # thread, with no hand-over of the GIL between the client's and the servers' threads
        return Client(
            cluster.address,
            client_cfg,
            inproc_address=cluster.controller.server.inproc_address,
            on_close=cluster.close,
            io=cluster.io,
            context=cluster.context,
        )
    except BaseException:
        cluster.close()
        raise
