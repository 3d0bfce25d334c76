"""The controller's connections to its storage units: a unit registering (or registering again
after a restart), the units a restarted controller reconnects to, and the units' part of
``stats``. Each unit is watched over its connection: when it drops the unit is lost, when it comes
back the unit revives, empty (``ControllerService._unit_down`` / ``_unit_up``). A unit says which
process it is (``boot``): one that answers at a unit's address as another process restarted
while nobody watched, so it holds none of the rows the controller placed there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from tqstream.controller.durable import UNIT_ADD
from tqstream.errors import TQStreamError
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    GetUnitStats,
    Registered,
    RegisterUnit,
    StatsReply,
    UnitStatsReply,
)
from tqstream.types import Stats, UnitStats

if TYPE_CHECKING:
    from tqstream.controller.service import ControllerService

__all__ = ["UnitLink", "add_unit", "open_unit", "reconnect", "register", "stats", "watch"]

_log = logging.getLogger("tqstream.controller")
Reply = tuple[Any, list[zmq.Frame]]


@dataclasses.dataclass(slots=True)
class UnitLink:
    """The controller's connection to one storage unit, and what the unit said of itself."""

    conn: Connection | None  # None while a restart replays its journal (connected after)
    inproc: str  # its in-process address ("" when reached over TCP only)
    shm: str  # its shared-memory token ("" without)
    boot: str  # its process ("" if it does not say)

    def request(self, req: msgspec.Struct, timeout: float | None) -> Awaitable[Reply]:
        """``req`` to the unit: its reply and frames (``Connection.request``)."""
        assert self.conn is not None, "a unit is asked nothing while the journal is replayed"
        return self.conn.request(req, timeout=timeout)


def add_unit(
    service: ControllerService, address: str, max_bytes: int, inproc: str, shm: str, boot: str,
    conn: Connection | None = None,
) -> int:  # fmt: skip
    """Add (or revive) the unit at ``address``; a lost unit registering again drops what it
    held. Journaled: a restart knows its units."""
    now = service._clock()
    if service.durable is not None:
        service.durable.event(UNIT_ADD, now, address, max_bytes, inproc, shm, boot)
    service.state.now = max(service.state.now, now)
    unit, effects = service.state.add_unit(address, max_bytes)
    if unit == len(service.links):
        service.links.append(UnitLink(conn, inproc, shm, boot))
        if conn is not None:
            watch(service, unit, conn)
    else:  # a restarted unit's segments have a new token
        link = service.links[unit]
        link.inproc, link.shm, link.boot = inproc, shm, boot
    service._apply(effects)
    return unit


def watch(service: ControllerService, unit: int, conn: Connection) -> None:
    conn.on_down = lambda: service._unit_down(unit)
    conn.on_up = lambda: service._unit_up(unit)


async def open_unit(service: ControllerService, address: str, timeout: float) -> Connection:
    return await Connection.open(
        service.ctx,
        address,
        role="controller",
        connect_timeout=timeout,
        heartbeat_interval=service.config.heartbeat_interval,
        max_message_bytes=service.config.max_message_bytes,
        keys=service.keys,
    )


async def register(service: ControllerService, msg: RegisterUnit) -> Registered:
    address = msg.address
    units = service.state.units
    conn = None
    if address not in units.addresses:
        conn = await open_unit(service, msg.inproc or address, service.config.connect_timeout)
        if address in units.addresses:  # registered twice at once: keep the first
            conn.close()
            conn = None
    if address in units.addresses:  # a restarted unit, or a repeated register
        unit = units.addresses.index(address)
        if units.alive[unit] and msg.boot and service.links[unit].boot not in ("", msg.boot):
            # it restarted while the controller was down (nobody saw it go): it is empty
            service._unit_down(unit)
    else:
        _log.info("storage unit %d registered at %s", len(service.links), address)
    unit = add_unit(service, address, msg.max_bytes, msg.inproc, msg.shm, msg.boot, conn)
    return Registered(rid=msg.rid, unit=unit)


async def reconnect(service: ControllerService, unit: int) -> None:
    """Connect to a unit the journal names; one that does not answer, or is another process
    than the one that held the rows, is lost (one that comes back registers again)."""
    link = service.links[unit]
    address = link.inproc or service.state.units.addresses[unit]
    timeout = min(service.config.connect_timeout, 5.0)
    try:
        conn = await open_unit(service, address, timeout)
    except TQStreamError as exc:
        _log.warning("storage unit %d at %s did not answer the restarted controller: %s",
                     unit, address, exc)  # fmt: skip
        conn = Connection(service.ctx, address, "controller", service.config.connect_timeout,
                          service.config.heartbeat_interval, service.config.max_message_bytes,
                          service.keys)  # fmt: skip
        link.conn = conn
        watch(service, unit, conn)
        service._unit_down(unit)
        return
    link.conn = conn
    watch(service, unit, conn)
    if service.state.units.alive[unit] and conn.welcome.boot != link.boot:
        service._unit_down(unit)  # restarted meanwhile: it holds none of its rows
        link.boot = conn.welcome.boot
        service._unit_up(unit)


async def stats(service: ControllerService, rid: int, partition: str | None) -> StatsReply:
    parts = service.state.stats(partition)

    async def one(i: int, link: UnitLink) -> UnitStats:
        if not service.state.units.alive[i]:
            return UnitStats(
                address=service.state.units.addresses[i], bytes=0, chunks=0, rows=0, alive=False
            )
        try:
            reply, _ = await link.request(GetUnitStats(rid=0), service.config.storage_timeout)
            assert isinstance(reply, UnitStatsReply)
            return reply.stats
        except TQStreamError:
            return UnitStats(
                address=service.state.units.addresses[i], bytes=-1, chunks=-1, rows=-1,
                alive=False,
            )  # fmt: skip

    units = await asyncio.gather(*(one(i, link) for i, link in enumerate(service.links)))
    stats = Stats(
        partitions=parts, units=list(units), admissions=service.state.admission_stats(),
        uptime=time.monotonic() - service._started,
    )  # fmt: skip
    return StatsReply(rid=rid, stats=stats)
