"""A controller's start on a journal: replay it, then reconnect the storage units.

The snapshot and the records after it are fed to a new state through the service's own handlers
(:mod:`tqstream.controller.durable`), every request under a :class:`~.durable.Stub` and at the
time it was first handled; the drop orders they make are held and sent once the units are
connected. A unit the journal names that does not answer, or that answers as another process (it
restarted while the controller was down, so it holds none of its rows), is lost: its rows are
counted lost (two copies: served from the other), as for a unit that dies while the controller
watches; it revives, empty, when it registers again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

from tqstream.controller import links
from tqstream.controller.durable import EXPIRE, PEER_GONE, REQUEST, UNIT_ADD, UNIT_DOWN, UNIT_UP
from tqstream.errors import TQStreamError
from tqstream.protocol.transport import _op

if TYPE_CHECKING:
    from tqstream.controller.service import ControllerService

__all__ = ["recover"]

_log = logging.getLogger("tqstream.controller")


async def recover(service: ControllerService) -> None:
    """Replay the snapshot and journal, then reconnect the storage units (a unit that is gone,
    or restarted, is lost: its rows counted lost) and carry out the drop orders replayed."""
    d = service.durable
    assert d is not None
    started = time.monotonic()
    payload = d.restored()
    if payload is not None:
        service.state = payload["state"]
        for inproc, shm, boot in payload["units"]:
            service.units.append(None)  # type: ignore[arg-type]  # connected below
            service.inproc_units.append(inproc)
            service.unit_shm.append(shm)
            service.unit_boot.append(boot)
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
    await asyncio.gather(*(links.reconnect(service, u) for u in range(len(service.units))))
    alive = service.state.units.alive
    for u, req in orders:
        if alive[u]:
            service._spawn(service._order(u, req))
    service._rearm()
    if payload is None and not records:
        return  # a fresh journal
    rows = sum(p.committed for p in service.state.partitions.values())
    _log.warning(
        "controller recovered from its journal in %s: %d records replayed in %.2fs; %d "
        "partitions, %d rows, %d leases, %d of %d storage units reachable",
        d.directory, records, time.monotonic() - started, len(service.state.partitions), rows,
        len(service.state.leases), sum(alive), len(alive),
    )  # fmt: skip
    if records:  # the next restart starts from here
        service._snapshot()


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
