"""The Ray actors of the Ray deployment: the controller and the storage units.

Each actor runs its tqstream server on a named loop thread of its own (as the embedded deployment
does), with its own ZMQ context, bound to its node's IP. The Ray methods only hand out addresses,
ports and process ids: rows never pass through Ray or its object store.

A storage unit that Ray restarts (``max_restarts``) asks the controller actor for the port its
predecessor served, binds it again, and registers: the controller knows the address, so the unit
revives under its old index, empty (its rows were counted lost when it died, unless replicated).
It also removes the shared-memory segments its predecessor left in ``/dev/shm``: a killed process
never unlinks them.

A server whose loop fails ends the actor's process: Ray then sees the actor die (and restarts a
storage unit), and clients see the server's connection drop, exactly as for a dead process of
``tqstream-launch``. A failure must never leave a live actor in front of a dead server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import ray

from tqstream.client.loop import LoopThread
from tqstream.config import ControllerConfig, StorageConfig
from tqstream.errors import TQStreamError
from tqstream.launch.worker import settle_heap
from tqstream.protocol.shm import process_key, remove_segments

__all__ = [
    "ControllerActor",
    "StorageUnitActor",
    "UnitRecord",
    "controller_name",
    "unit_name",
]

_log = logging.getLogger("tqstream")


def controller_name(cluster: str) -> str:
    """The Ray actor name of cluster ``cluster``'s controller."""
    return f"{cluster}-controller"


def unit_name(cluster: str, index: int) -> str:
    """The Ray actor name of cluster ``cluster``'s storage unit ``index``."""
    return f"{cluster}-unit-{index}"


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    """What the controller actor remembers of storage unit ``i`` across its restarts."""

    port: int
    """The TCP port the unit serves; a restart binds it again."""
    address: str
    """``tcp://IP:PORT``, as the controller knows the unit."""
    shm_token: str
    """The token of the unit's shared-memory segments (``/dev/shm/tqs-<token>-*``); "" if none."""


class _Served:
    """One tqstream server (``build(ctx)``: a ControllerService or a StorageService) serving on a
    loop thread of this process. ``stop()`` closes it and frees its port; idempotent."""

    def __init__(self, build: Callable[[Any], Any], role: str, register: bool = False) -> None:
        self.role = role
        self._stopped = False
        self._lock = threading.Lock()
        self.io = LoopThread(name=f"tqstream-ray-{role}")
        try:
            self.service = self.io.run(self._start(build, register))
        except BaseException:
            self._stopped = True  # what ends now is no failure to report
            self.io.run(self._close())
            self.io.stop()
            raise
        settle_heap()  # the actor's process is this server's alone

    async def _start(self, build: Callable[[Any], Any], register: bool) -> Any:
        from tqstream.protocol.transport import context

        self._ctx = context()
        self.service = build(self._ctx)
        self._serving = asyncio.get_running_loop().create_task(
            self.service.serve(), name=f"tqstream-ray-{self.role}-serve"
        )
        self._serving.add_done_callback(self._ended)
        if register:
            await self.service.register()
        return self.service

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if self._stopped or task.cancelled() or task.exception() is None:
            return
        _log.error(
            "tqstream %s server failed; ending its Ray actor's process",
            self.role,
            exc_info=task.exception(),
        )
        os._exit(1)  # Ray sees the actor die; clients see the connection drop

    async def _close(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            await service.close()
        serving = getattr(self, "_serving", None)
        if serving is not None:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        if hasattr(self, "_ctx"):
            self._ctx.destroy(linger=0)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self.io.run(self._close())
        finally:
            self.io.stop()


class _ServerActor:
    """What the controller and unit actors share: the server they run and where it runs."""

    _server: _Served

    def address(self) -> str:
        return str(self._server.service.address)

    def pid(self) -> int:
        return os.getpid()

    def process(self) -> tuple[int, str]:
        """``(pid, process_key())``: how ``shutdown`` on the same host sees the process end."""
        return os.getpid(), process_key()

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def stop(self) -> None:
        """Close the server's sockets (its port is free once this returns; a unit also unlinks
        its shared memory). Idempotent."""
        self._server.stop()


class ControllerActor(_ServerActor):
    """The cluster's controller, and the registry of its storage units' ports by launch index.

    ``max_restarts=0``: a restarted controller would be an empty cluster that no client or unit
    knows; its death ends the cluster (clients get ConnectionLostError)."""

    def __init__(self, config: ControllerConfig) -> None:
        from tqstream.controller.service import ControllerService

        config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self._config = config
        self._units: dict[int, UnitRecord] = {}
        self._server = _Served(lambda ctx: ControllerService(config, ctx), "controller")

    def endpoint(self) -> tuple[str, str]:
        """``(address, key file path)`` — what a client needs ("" : the cluster has no keys)."""
        return self.address(), self._config.keys

    def metrics_address(self) -> str:
        """``http://IP:PORT/metrics``, or "" when the cluster has no metrics endpoint."""
        return str(self._server.service.metrics_address)

    def unit(self, index: int) -> UnitRecord | None:
        return self._units.get(index)

    def set_unit(self, index: int, record: UnitRecord) -> None:
        self._units[index] = record

    def units(self) -> dict[int, UnitRecord]:
        return dict(self._units)


class StorageUnitActor(_ServerActor):
    """Storage unit ``index`` of cluster ``cluster`` in Ray namespace ``namespace``.

    It finds the controller actor by name on every (re)start: an actor handle among the
    constructor arguments would live in the object store, where a restart might not find it."""

    def __init__(self, index: int, cluster: str, namespace: str, config: StorageConfig) -> None:
        from tqstream.storage.service import StorageService

        controller: Any = ray.get_actor(controller_name(cluster), namespace=namespace)
        host = ray.util.get_node_ip_address()
        before: UnitRecord | None = ray.get(controller.unit.remote(index))
        address: str = ray.get(controller.address.remote())
        if before is not None and before.shm_token:
            remove_segments(before.shm_token)
        port = before.port if before is not None else config.port

        def build(port: int) -> Callable[[Any], Any]:
            unit_config = dataclasses.replace(config, host=host, port=port)
            return lambda ctx: StorageService(unit_config, address, ctx)

        try:
            self._server = _Served(build(port), f"storage-{index}", register=True)
        except OSError as exc:
            if not port or isinstance(exc, TQStreamError):  # not the bind: e.g. ConnectError
                raise
            _log.warning(
                "tqstream storage unit %d cannot bind its port %d again (%s); it serves at a new "
                "port and registers as a new unit: the controller keeps its old index as lost",
                index,
                port,
                exc,
            )
            self._server = _Served(build(0), f"storage-{index}", register=True)
        service = self._server.service
        segments = service.segments
        record = UnitRecord(
            port=int(service.address.rsplit(":", 1)[1]),
            address=service.address,
            shm_token=segments.token if segments is not None else "",
        )
        ray.get(controller.set_unit.remote(index, record))
