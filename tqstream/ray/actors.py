"""The Ray actors of the Ray deployment: the controller and the storage units.

Each actor runs its tqstream server on a named loop thread of its own (as the embedded deployment
does), with its own ZMQ context, bound to its node's IP. The Ray methods only hand out addresses,
ports and process ids: rows never pass through Ray or its object store.

A storage unit that Ray restarts (``max_restarts``) asks the controller actor for the port its
predecessor served, binds it again, and registers: the controller knows the address, so the unit
revives under its old index, empty (its rows were counted lost when it died, unless replicated).
It also removes the shared-memory segments its predecessor left in ``/dev/shm``: a killed process
never unlinks them.

A controller with a journal is restarted too (``launch`` pins it to its node, where the journal
is): the new process replays the journal, binds the port its predecessor served and takes over
its registry of the units, both kept in the journal directory (:data:`REGISTRY`), so clients and
units reconnect to the address they knew and a unit that restarts later still finds its port.

A server whose loop fails ends the actor's process: Ray then sees the actor die (and restarts a
storage unit), and clients see the server's connection drop, exactly as for a dead process of
``tqstream-launch``. A failure must never leave a live actor in front of a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import ray

from tqstream.client.loop import LoopThread
from tqstream.config import ControllerConfig, StorageConfig
from tqstream.errors import JournalCorruptError, TQStreamError
from tqstream.launch.worker import settle_heap
from tqstream.protocol.disk import fsync_dir, write_durably
from tqstream.protocol.shm import process_key, remove_segments

__all__ = [
    "REGISTRY",
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


REGISTRY = "ray-controller.json"
"""The controller actor's file in its journal directory: its port and its units' records, which
a restarted controller actor needs to serve where its predecessor did."""


class _Registry(msgspec.Struct, frozen=True):
    """What :data:`REGISTRY` holds."""

    port: int
    units: dict[int, UnitRecord]


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

    Without a journal (``durability="off"``) ``launch`` creates it with ``max_restarts=0``: a
    restarted controller would be an empty cluster that no client or unit knows, so its death
    ends the cluster (clients get ConnectionLostError). With a journal Ray restarts it on its
    node (``max_restarts=-1``): the new process reads :data:`REGISTRY` in the journal directory,
    binds its predecessor's port, knows its units' records again, and replays the journal; the
    file is rewritten whenever the port or a unit's record is set. A first start (not a restart)
    takes the configured port and starts the file anew, as the journal may be of an earlier
    launch whose ports are someone else's by now."""

    def __init__(self, config: ControllerConfig) -> None:
        from tqstream.controller.service import ControllerService

        config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self._units: dict[int, UnitRecord] = {}
        self._journal = config.journal if config.durability != "off" else ""
        if self._journal and ray.get_runtime_context().was_current_actor_reconstructed:
            before = _read_registry(os.path.join(self._journal, REGISTRY))
            if before is not None:
                config = dataclasses.replace(config, port=before.port)
                self._units = dict(before.units)
        self._config = config
        self._server = _Served(lambda ctx: ControllerService(config, ctx), "controller")
        try:
            self._save()
        except BaseException:  # no live server behind an actor that failed to start
            self._server.stop()
            raise

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
        self._save()

    def units(self) -> dict[int, UnitRecord]:
        return dict(self._units)

    def _save(self) -> None:
        """Write :data:`REGISTRY` whole (aside, fsynced, renamed into place): a process killed
        mid-write leaves the previous file."""
        if not self._journal:
            return
        port = int(self.address().rsplit(":", 1)[1])
        path = os.path.join(self._journal, REGISTRY)
        tmp = f"{path}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        write_durably(tmp, [msgspec.json.encode(_Registry(port=port, units=self._units))])
        os.replace(tmp, path)
        fsync_dir(self._journal)


def _read_registry(path: str) -> _Registry | None:
    """The registry a controller actor of this journal left; None if there is none."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=_Registry)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as exc:  # it is only ever replaced whole: damaged from outside
        raise JournalCorruptError(
            f"{path} is damaged ({exc}): a restarted controller actor reads its port and its "
            f"storage units' records there; restore it, or launch the cluster again on this "
            f"journal (a first start writes it anew)",
            path=path,
        ) from exc


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
