"""The storage unit's event loop: one ROUTER socket in front of a :class:`ColumnStore`.

Received tensor frames are stored as they arrived: ``column_from_wire`` builds tensors over the ZMQ
frames without copying, so a stored chunk *is* the received message memory, released when the
chunk's last row is dropped. A fetch of rows that sit contiguously in one chunk is answered with
views of that memory (sent zero-copy); scattered rows cost one gather.

On start the unit registers its address with the controller, which from then on sends it drop
orders; clients learn the address from the controller.
"""

from __future__ import annotations

from typing import Any

import zmq.asyncio

from tqstream.config import ClientConfig, StorageConfig
from tqstream.errors import InvalidRequestError
from tqstream.protocol.codec import column_from_wire, columns_to_wire
from tqstream.protocol.messages import (
    Columns,
    DropChunks,
    DropPartition,
    DropRows,
    Fetch,
    GetUnitStats,
    Ok,
    RegisterUnit,
    Store,
    UnitStatsReply,
)
from tqstream.protocol.transport import Connection, Responder, Server
from tqstream.storage.columns import ColumnStore
from tqstream.types import UnitStats

__all__ = ["StorageService"]


class StorageService:
    def __init__(
        self,
        config: StorageConfig,
        controller: str | None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self.controller = controller
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.store = ColumnStore()
        self.server = Server(
            self.ctx,
            config.host,
            config.port,
            self.handle,
            name="storage",
            max_message_bytes=config.max_message_bytes,
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
            msg = RegisterUnit(rid=0, address=self.address, max_bytes=self.config.max_bytes)
            reply, _ = await conn.request(msg, timeout=30.0)
        finally:
            await conn.close()
        self.unit = reply.unit
        return reply.unit

    async def serve(self) -> None:
        await self.server.serve()

    async def close(self) -> None:
        await self.server.close()

    def handle(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        s = self.store
        match msg:
            case Store():
                columns = {ref.name: column_from_wire(ref, frames) for ref in msg.columns}
                s.add_chunk(msg.partition, msg.chunk, msg.row_ids, columns)
                return Ok(rid=msg.rid, count=len(msg.row_ids))
            case Fetch():
                columns = s.fetch(msg.partition, msg.row_ids, msg.fields)
                refs, buffers = columns_to_wire(columns)
                return Columns(rid=msg.rid, columns=refs), buffers
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
                )
                return UnitStatsReply(rid=msg.rid, stats=stats)
            case _:
                raise InvalidRequestError(
                    f"{type(msg).__name__} is not a storage request; it goes to the controller"
                )
