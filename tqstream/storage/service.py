"""The storage unit's event loop: one ROUTER socket in front of a :class:`ColumnStore`.

Received tensor frames are stored as they arrived: ``column_from_wire`` builds tensors over the ZMQ
frames without copying, so a stored chunk *is* the received message memory, released when the
chunk's last row is dropped. A fetch of rows that sit contiguously in one chunk is answered with
views of that memory (sent zero-copy); scattered rows cost one gather.

On start the unit registers its address with the controller, which from then on sends it drop
orders; clients learn the address from the controller.

Clients on the same host move tensor bytes through shared memory instead (``protocol/shm.py``): a
``Store`` names the segment the client wrote, which becomes the chunk's memory, and a ``Fetch``
with ``shared`` is answered with regions of the chunk segments (zero copy) or of a fresh segment
holding gathered rows. A dropped chunk's segment is kept as a spare for a later put (once nobody
maps it) or unlinked; every name the unit owns is unlinked at close.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from tqstream.config import ClientConfig, StorageConfig
from tqstream.errors import InvalidRequestError
from tqstream.protocol import shm
from tqstream.protocol.codec import column_from_wire, columns_to_wire
from tqstream.protocol.messages import (
    Columns,
    DropChunks,
    DropPartition,
    DropRows,
    Fetch,
    GetUnitStats,
    Ok,
    Region,
    RegisterUnit,
    Store,
    UnitStatsReply,
)
from tqstream.protocol.transport import Connection, Responder, Server, shared_context
from tqstream.storage.columns import ColumnStore
from tqstream.types import UnitStats

__all__ = ["StorageService"]

GATHER_UNLINK_DELAY = 60.0
"""Seconds after which a gather segment is unlinked even if its client never mapped it."""


class StorageService:
    def __init__(
        self,
        config: StorageConfig,
        controller: str | None,
        ctx: zmq.Context[Any] | None = None,
        inproc: bool = False,
    ) -> None:
        self.config = config
        self.controller = controller
        self.ctx = ctx or shared_context()
        self.segments = shm.UnitSegments() if shm.available() else None
        self._dropped: list[int] = []
        self.store = ColumnStore(on_release=self._released)
        self.server = Server(
            self.ctx,
            config.host,
            config.port,
            self.handle,
            name="storage",
            max_message_bytes=config.max_message_bytes,
            shm=self.segments.token if self.segments else "",
            inproc=inproc,
        )
        self.unit: int | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def register(self) -> int:
        """Announce this unit to the controller (the server must already be serving)."""
        assert self.controller is not None
        conn = await Connection.open(
            self.ctx,
            self.controller,
            role="storage",
            connect_timeout=ClientConfig.connect_timeout,
            heartbeat_interval=ClientConfig.heartbeat_interval,
            max_message_bytes=self.config.max_message_bytes,
        )
        try:
            msg = RegisterUnit(
                rid=0,
                address=self.address,
                max_bytes=self.config.max_bytes,
                inproc=self.server.inproc_address,
            )
            reply, _ = await conn.request(msg, timeout=30.0)
        finally:
            conn.close()
        self.unit = reply.unit
        return reply.unit

    async def serve(self) -> None:
        await self.server.serve()

    async def close(self) -> None:
        await self.server.close()
        if self.segments is not None:
            self.segments.close()

    def _released(self, chunk: int, held: bool) -> None:
        """Note the chunk if it may have a segment (it was stored through shared memory, or never
        arrived); the segment is recycled or unlinked by ``handle`` once the store's operation
        returned, so the chunk's tensors are gone (a spare must not be mapped here)."""
        if self.segments is not None and (not held or self.segments.holds(chunk)):
            self._dropped.append(chunk)

    def _store(self, msg: Store, frames: list[Any]) -> Ok:
        if not msg.shared:
            columns = {ref.name: column_from_wire(ref, frames) for ref in msg.columns}
            self.store.add_chunk(msg.partition, msg.chunk, msg.row_ids, columns)
            return Ok(rid=msg.rid, count=len(msg.row_ids))
        if self.segments is None:
            raise InvalidRequestError(
                "this storage unit has no shared memory; send the tensors as frames",
                chunk=msg.chunk,
            )
        if msg.reused:
            self.segments.claimed(msg.reused)
        try:
            self.store.check_arrival(msg.partition, msg.chunk)  # before the segment's name is used
            views = [frames[0], *self.segments.adopt(msg.chunk, msg.shared)]
            columns = {ref.name: column_from_wire(ref, views) for ref in msg.columns}
            self.store.add_chunk(msg.partition, msg.chunk, msg.row_ids, columns)
        except BaseException:
            if not self.store.holds(msg.chunk):  # nothing stored: leave no orphan segment either
                self.segments.release(msg.chunk)
            raise
        return Ok(rid=msg.rid, count=len(msg.row_ids), spare=self.segments.spares())

    def _fetch(self, msg: Fetch) -> tuple[Columns, list[Any]]:
        columns = self.store.fetch(msg.partition, msg.row_ids, msg.fields)
        refs, buffers = columns_to_wire(columns)
        if not msg.shared or self.segments is None:
            return Columns(rid=msg.rid, columns=refs), buffers
        shared: dict[int, Region] = {}
        out: list[Any] = list(buffers)
        rest: list[int] = []  # frame indices of buffers that are not in a chunk segment
        for i, buf in enumerate(buffers, 1):
            region = self.segments.region(buf)
            if region is None:
                rest.append(i)
            else:
                shared[i], out[i - 1] = region, b""
        gathered = sum(memoryview(buffers[i - 1]).nbytes for i in rest)
        if rest and gathered >= shm.GATHER_SEGMENT_BYTES:
            try:
                regions = self.segments.gather_segment([buffers[i - 1] for i in rest])
            except OSError:  # e.g. /dev/shm is full: these buffers go as frames
                regions = []
            for i, region in zip(rest, regions, strict=False):
                shared[i], out[i - 1] = region, b""
            if regions:
                loop = asyncio.get_running_loop()
                loop.call_later(GATHER_UNLINK_DELAY, shm.unlink, regions[0].name)
        return Columns(rid=msg.rid, columns=refs, shared=shared), out

    def handle(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        try:
            return self._handle(msg, frames)
        finally:  # before the answer: a dropped chunk's segment is gone once the drop is answered
            while self._dropped and self.segments is not None:
                self.segments.release(self._dropped.pop())

    def _handle(self, msg: Any, frames: list[Any]) -> Any:
        s = self.store
        match msg:
            case Store():
                return self._store(msg, frames)
            case Fetch():
                return self._fetch(msg)
            case DropRows():
                return Ok(rid=msg.rid, count=s.drop_rows(msg.partition, msg.row_ids))
            case DropChunks():
                s.drop_chunks(msg.chunks)
                return Ok(rid=msg.rid)
            case DropPartition():
                s.drop_partition(msg.partition, msg.before_chunk)
                return Ok(rid=msg.rid)
            case GetUnitStats():
                stats = UnitStats(
                    address=self.address,
                    bytes=s.bytes,
                    chunks=s.chunks,
                    rows=s.rows,
                    max_bytes=self.config.max_bytes,
                    spare_bytes=self.segments.spare_bytes if self.segments else 0,
                )
                return UnitStatsReply(rid=msg.rid, stats=stats)
            case _:
                raise InvalidRequestError(
                    f"{type(msg).__name__} is not a storage request; it goes to the controller"
                )
