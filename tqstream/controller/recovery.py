"""A controller's start on a journal: replay it, then reconnect the storage units.

The snapshot and the records after it are fed to a new state through the service's own handlers
(:mod:`tqstream.controller.durable`), every request under a :class:`~.durable.Stub` and at the
time it was first handled; the drop orders they make are held and sent once the units are
connected. A unit the journal names that does not answer, or that answers as another process (it
restarted while the controller was down, so it holds none of its rows), is lost: its rows are
counted lost (two copies: served from the other), as for a unit that dies while the controller
watches; it revives, empty, when it registers again.

Then each reachable unit says which rows it holds (``GetInventory``), and the rows no row of the
state names are freed: the bytes of a drop order that died with the last process, or of a
partition cleared meanwhile. And every client session the journal knows (one whose request was
journaled and that has not disconnected) has ``reconnect_grace`` seconds to reconnect; what one
that does not come back held (puts in flight, leases, admission slots, parked gets) is rolled back
as for a client whose connection dropped (it died while the controller was down).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from tqstream.controller import links
from tqstream.controller.durable import EXPIRE, PEER_GONE, REQUEST, UNIT_ADD, UNIT_DOWN, UNIT_UP
from tqstream.errors import TQStreamError
from tqstream.protocol.messages import DropPartition, DropRows, GetInventory, InventoryReply
from tqstream.protocol.transport import _op

if TYPE_CHECKING:
    from tqstream.controller.service import ControllerService

__all__ = ["recover"]

_log = logging.getLogger("tqstream.controller")


async def recover(service: ControllerService) -> None:
    """Replay the snapshot and journal, then reconnect the storage units (a unit that is gone,
    or restarted, is lost: its rows counted lost), carry out the drop orders replayed, free the
    rows no row names, and give the client sessions known ``reconnect_grace`` to come back."""
    d = service.durable
    assert d is not None
    started = time.monotonic()
    payload = d.restored()
    if payload is not None:
        service.state = payload["state"]
        for inproc, shm, boot in payload["units"]:
            service.links.append(links.UnitLink(None, inproc, shm, boot))  # connected below
    service._orders = []
    d.replaying = True
    records = 0
    try:
        for kind, rec in d.records():
            records += 1
            service._replay_now = now = rec[0]
            if kind == REQUEST:
                await _replay_request(service, rec[1], rec[2], rec[3], now)
            elif kind == EXPIRE:
                service._on_timer()
            elif kind == PEER_GONE:
                service._peer_gone(rec[1])
            elif kind == UNIT_DOWN:
                service._event(lambda now, u=rec[1]: service.state.lose_unit(u, now))
            elif kind == UNIT_UP:
                service._event(lambda now, u=rec[1]: service.state.revive_unit(u))
            elif kind == UNIT_ADD:
                service._add_unit(*rec[1:])
    finally:
        d.replaying = False
        service._replay_now = None
    orders, service._orders = service._orders, None
    await asyncio.gather(*(links.reconnect(service, u) for u in range(len(service.links))))
    alive = service.state.units.alive
    sent = [service._spawn(service._order(u, req)) for u, req in orders if alive[u]]
    await asyncio.gather(*sent, return_exceptions=True)  # counted in drop_failures
    service._rearm()
    freed = await asyncio.gather(*(_free_orphans(service, u) for u in range(len(alive))))
    peers = set(d.peers)
    if peers:
        asyncio.get_running_loop().call_later(
            service.config.reconnect_grace, _drop_absent, service, peers
        )
    if payload is None and not records:
        return  # a fresh journal
    rows = sum(p.committed for p in service.state.partitions.values())
    _log.warning(
        "controller recovered from its journal in %s: %d records replayed in %.2fs; %d "
        "partitions, %d rows, %d leases, %d of %d storage units reachable, %d rows freed there "
        "that no row named; waiting %gs for %d client sessions to reconnect",
        d.directory, records, time.monotonic() - started, len(service.state.partitions), rows,
        len(service.state.leases), sum(alive), len(alive), sum(freed),
        service.config.reconnect_grace, len(peers),
    )  # fmt: skip
    if records:  # the next restart starts from here
        service._snapshot()


async def _free_orphans(service: ControllerService, unit: int) -> int:
    """Have ``unit`` free the rows it holds that no row of the state names (or of an earlier
    incarnation of their partition); the rows freed."""
    if not service.state.units.alive[unit]:
        return 0
    try:
        reply, _ = await service.links[unit].request(
            GetInventory(rid=0), service.config.storage_timeout
        )
    except TQStreamError as exc:  # it died since: lost, as the watch says
        _log.warning("storage unit %d did not list its rows: %s", unit, exc)
        return 0
    assert isinstance(reply, InventoryReply)
    freed = 0
    for held in reply.partitions:
        p = service.state.partitions.get(held.partition)
        order: DropPartition | DropRows
        if p is None or held.generation != p.born:  # all of it: unknown, or cleared since
            before = p.born if p is not None and held.generation < p.born else 0
            order = DropPartition(rid=0, partition=held.partition, before_chunk=before)
            extra = held.count()
        else:
            orphans = np.setdiff1d(held.row_ids(), p.rows.on_unit(unit), assume_unique=True)
            order = DropRows(rid=0, partition=held.partition, row_ids=orphans.tolist())
            extra = len(orphans)
        if extra:
            _log.warning(
                "storage unit %d held %d rows of partition %r that no row of the controller's "
                "journal names: freed", unit, extra, held.partition,
            )  # fmt: skip
            with contextlib.suppress(TQStreamError):  # counted in drop_failures
                await service._order(unit, order)
            freed += extra
    return freed


def _drop_absent(service: ControllerService, peers: set[Any]) -> None:
    """The sessions of ``peers`` that did not reconnect died while the controller was down: what
    they held is rolled back."""
    d = service.durable
    if service.server_closed or d is None:
        return
    gone = [p for p in peers if p in d.peers and not service.server.connected(p)]
    for peer in gone:
        service._peer_gone(peer)
    if gone:
        _log.warning(
            "%d of the %d client sessions the journal knew did not reconnect within %gs: what "
            "they held (puts in flight, leases, admission slots) is rolled back",
            len(gone), len(peers), service.config.reconnect_grace,
        )  # fmt: skip


async def _replay_request(
    service: ControllerService, peer: Any, rid: int, header: bytes, now: float
) -> None:
    assert service.durable is not None
    msg = service.durable.decode(header)
    stub = service.durable.stub(peer, rid, _op(msg))
    try:
        result = service._handle(msg, stub, now)
        if inspect.isawaitable(result):
            result = await result
    except Exception as exc:  # it changed nothing, as the first time
        if not isinstance(exc, TQStreamError):
            _log.error("replaying %s (request %d) failed", stub.op, rid, exc_info=exc)
        service.durable.answers.forget(stub.key)
        return
    if result is not None:
        stub.reply(result[0] if isinstance(result, tuple) else result)
