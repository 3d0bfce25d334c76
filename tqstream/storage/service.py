"""The storage unit's event loop: one ROUTER socket in front of a :class:`ColumnStore`.

Received tensor frames are stored as they arrived: ``column_from_wire`` builds tensors over the ZMQ
frames without copying, so a stored chunk *is* the received message memory, released when the
chunk's last row is dropped. A fetch of rows that sit contiguously in one chunk is answered with
views of that memory (sent zero-copy); scattered rows cost one gather.

On start the unit registers its address with the controller, which from then on sends it drop
orders; clients learn the address from the controller. The unit keeps that connection (its *link*)
for small puts made in one exchange (``PutRows``): it decodes and holds the columns, asks the
controller to place and commit the rows on it (``PutStored``), indexes them under the row ids of the
reply and answers the client with the committed metadata.

A stored put's rows are visible to readers from the moment the controller commits them, and the
controller's reply reaches the unit over the link, not over the socket the readers' fetches and the
controller's drop orders come in on: a fetch or a drop of those rows can be handled first. Every put
in flight is a *landing*, registered before its ``PutStored`` is sent, hence before any message
about its rows can exist. A fetch of rows the unit does not hold waits for the landings of its
partition that were in flight when it arrived, then is served (or fails) as usual; drops of rows
not held, and partition clears, are noted on those landings and applied when each one lands.

Clients on the same host move tensor bytes through shared memory instead (``protocol/shm.py``): a
``Store`` names the segment the client wrote, which becomes the chunk's memory, and a ``Fetch``
with ``shared`` is answered with regions of the chunk segments (zero copy) or of a fresh segment
holding gathered rows. A dropped chunk's segment is kept as a spare for a later put (once nobody
maps it) or unlinked; every name the unit owns is unlinked at close.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Mapping
from typing import Any

import msgspec
import zmq

from tqstream.config import StorageConfig
from tqstream.errors import (
    ClosedError,
    InternalError,
    InvalidRequestError,
    MalformedMessageError,
    StaleRowError,
    TQStreamError,
    UnknownRowError,
)
from tqstream.protocol import shm
from tqstream.protocol.auth import load_keys
from tqstream.protocol.columns import Column
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    Columns,
    DropChunks,
    DropPartition,
    DropRows,
    ErrorReply,
    Fetch,
    GetInventory,
    GetUnitStats,
    HeldRows,
    InventoryReply,
    LoadUnit,
    MetaReply,
    Ok,
    PreparePut,
    Publish,
    PutRows,
    PutStored,
    Region,
    RegisterUnit,
    ResetUnit,
    SaveUnit,
    Store,
    StoredRelay,
    StoredRelays,
    UnitStatsReply,
    UnitStopping,
    decode_unit_reply,
)
from tqstream.protocol.server import Responder, Server
from tqstream.protocol.transport import error_from_reply, shared_context
from tqstream.protocol.wire import column_from_wire, columns_to_wire
from tqstream.storage.checkpoint import UnitCheckpoints
from tqstream.storage.columns import ColumnStore
from tqstream.types import FieldSchema, UnitStats

__all__ = ["StorageService"]

GATHER_UNLINK_DELAY = 60.0
"""Seconds after which a gather segment is unlinked even if its client never mapped it."""

LANDING_WAIT = 10.0
"""Longest wait of a fetch of rows the unit does not hold for the puts landing in its partition."""

PUT_GRACE = 10.0
"""Extra seconds the unit waits for the controller's answer to a put beyond the put's timeout."""


class _Landing:
    """A stored put whose commit is in flight (see the module docstring)."""

    __slots__ = ("answer", "cleared_before", "done", "drops", "local", "put", "segment")

    def __init__(
        self,
        put: PreparePut,
        answer: asyncio.Future[StoredRelay],
        done: asyncio.Future[None],
        segment: str = "",
        local: bool = False,
    ) -> None:
        self.put = put
        self.local = local  # the writer is on this host
        self.segment = segment  # the shared-memory segment holding the columns ("" for frames)
        self.answer = answer  # the controller's answer
        self.done = done  # set once the put is over (indexed, refused or failed)
        self.drops: set[int] = set()  # row ids whose drop order came before the rows
        self.cleared_before = -1  # the partition was cleared up to this chunk id (0: all)


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
        self.keys = load_keys(config.keys) if config.keys else None
        self.stored = {True: 0, False: 0}  # bytes stored: from writers on this host, or not
        self.served = {True: 0, False: 0}  # bytes read: by readers on this host, or not
        self.segments = shm.UnitSegments() if shm.available() else None
        self._dropped: list[int] = []
        self.store = ColumnStore(on_release=self._released)
        self.boot = secrets.token_hex(8)  # this process (a restart at the address has another)
        self.server = Server(
            self.ctx,
            config.host,
            config.port,
            self.handle,
            name="storage",
            max_message_bytes=config.max_message_bytes,
            shm=self.segments.token if self.segments else "",
            inproc=inproc,
            keys=self.keys,
            controller=controller or "",
            boot=self.boot,
        )
        self.unit: int | None = None
        self._link: Connection | None = None  # to the controller, for stored puts
        self._landings: set[_Landing] = set()
        self.checkpoints = UnitCheckpoints(
            self.store, lambda p: [x.done for x in self._in_flight(p)], lambda: self.address
        )
        self._outgoing: list[_Landing] = []  # stored puts not sent to the controller yet
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

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
            connect_timeout=self.config.connect_timeout,
            heartbeat_interval=self.config.heartbeat_interval,
            max_message_bytes=self.config.max_message_bytes,
            keys=self.keys,
        )
        conn.decode = decode_unit_reply  # a put's metadata is relayed, not decoded (StoredRelay)
        conn.resend = conn.welcome.durable  # a restarted controller gets the puts in flight
        try:
            msg = RegisterUnit(
                rid=0,
                address=self.address,
                max_bytes=self.config.max_bytes,
                inproc=self.server.inproc_address,
                shm=self.segments.token if self.segments else "",
                boot=self.boot,
            )
            reply, _ = await conn.request(msg, timeout=30.0)
        except BaseException:
            conn.close()
            raise
        if self._link is not None:
            self._link.close()
        self._link = conn
        self.unit = reply.unit
        return reply.unit

    async def serve(self) -> None:
        await self.server.serve()

    async def close(self) -> None:
        """Stop serving; a registered unit first tells its controller it is stopping (so the
        dropped connection reads as a shutdown there, not a loss), waiting for it briefly."""
        if self._link is not None and self.unit is not None and not self._closed:
            with contextlib.suppress(TQStreamError):
                await self._link.request(UnitStopping(rid=0, unit=self.unit), timeout=1.0)
        self._closed = True
        await self.server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._link is not None:
            self._link.close()
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
            self.store.add_chunk(
                msg.partition, msg.chunk, msg.rows(), columns, msg.overwrite, msg.generation
            )
            self._count(columns, msg.local)
            return Ok(rid=msg.rid, count=len(msg.rows()))
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
            self.store.add_chunk(
                msg.partition, msg.chunk, msg.rows(), columns, msg.overwrite, msg.generation
            )
        except BaseException:
            if not self.store.holds(msg.chunk):  # nothing stored: leave no orphan segment either
                self.segments.release(msg.chunk)
            raise
        self._count(columns, msg.local)
        return Ok(rid=msg.rid, count=len(msg.rows()), spare=self.segments.spares())

    def _count(self, columns: Mapping[str, Column], local: bool) -> None:
        """Bytes stored, by where their writer was (``UnitStats.local_bytes``)."""
        self.stored[local] += sum(col.nbytes for col in columns.values())

    # --- stored puts ---
    def _put(self, msg: PutRows, frames: list[Any]) -> Awaitable[MetaReply]:
        put, segment = msg.put, ""
        if self._link is None or self.unit is None:
            raise InvalidRequestError(
                "this storage unit is not registered with a controller, so it cannot take puts "
                "directly; start it with a controller address"
            )
        if msg.shared:
            if self.segments is None:
                raise InvalidRequestError(
                    "this storage unit has no shared memory; send the tensors as frames"
                )
            segment, views = self.segments.take(msg.shared, msg.reused)
            frames = [frames[0], *views]
        try:
            columns = {ref.name: column_from_wire(ref, frames, put.n_rows) for ref in msg.columns}
            schemas = {name: col.schema for name, col in columns.items()}
            if schemas != put.schemas:
                raise MalformedMessageError(
                    f"the put's schemas {_describe(put.schemas)} do not match its columns "
                    f"{_describe(schemas)}",
                    partition=put.partition,
                )
        except BaseException:
            if segment:
                self.segments.untake(segment)  # type: ignore[union-attr]
            raise
        nbytes = sum(col.nbytes for col in columns.values())
        put = msgspec.structs.replace(put, rid=0, nbytes=nbytes)
        loop = asyncio.get_running_loop()
        landing = _Landing(put, loop.create_future(), loop.create_future(), segment, msg.local)
        self._landings.add(landing)
        if not self._outgoing:  # after this drain of the socket: one PutStored for its puts
            loop.call_soon(self._send_stored)
        self._outgoing.append(landing)
        return self._land(msg.rid, landing, columns)

    def _send_stored(self) -> None:
        landings, self._outgoing = self._outgoing, []
        if self._closed:
            for x in landings:
                x.answer.set_exception(ClosedError("the storage unit closed during the put"))
            return
        task = asyncio.get_running_loop().create_task(
            self._commit(landings), name="tqstream-storage-put-stored"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, landings: list[_Landing]) -> None:
        """Have the controller commit the puts; each landing gets its own answer."""
        assert self._link is not None and self.unit is not None
        timeouts = [x.put.timeout for x in landings]
        wait = None if None in timeouts else max(t or 0.0 for t in timeouts) + PUT_GRACE
        req = PutStored(rid=0, unit=self.unit, puts=[x.put for x in landings])
        try:
            reply, _ = await self._link.request(req, timeout=wait)
            if not isinstance(reply, StoredRelays) or len(reply.results) != len(landings):
                raise InternalError(f"expected {len(landings)} StoredResults, got {reply!r}")
        except asyncio.CancelledError:  # the unit is closing
            for x in landings:
                x.answer.cancel()
            raise
        except Exception as exc:  # the link failed: every put fails with it
            for x in landings:
                x.answer.set_exception(exc)
            return
        for x, result in zip(landings, reply.results, strict=True):
            if isinstance(result, ErrorReply):
                x.answer.set_exception(error_from_reply(result))
            else:
                x.answer.set_result(result)

    async def _land(self, rid: int, landing: _Landing, columns: dict[str, Column]) -> MetaReply:
        partition, segment = landing.put.partition, landing.segment
        try:
            reply = await landing.answer
            rows = reply.row_ids()
            # the partition cleared since the commit, and written to again: these rows are gone
            stale = self.store.stale(partition, reply.generation)
            if not stale:
                self.checkpoints.landed(partition, reply.chunk, rows, columns)  # before its drops
            before = landing.cleared_before
            if not stale and (before < 0 or (before and reply.chunk >= before)):  # not cleared
                if segment:  # named as the chunk's before any fetch can answer with its regions
                    self.segments.landed(reply.chunk, segment)  # type: ignore[union-attr]
                    segment = ""
                try:
                    self.store.add_chunk(
                        partition, reply.chunk, rows, columns, generation=reply.generation
                    )
                except BaseException:
                    self._released(reply.chunk, False)
                    raise
                self._count(columns, landing.local)
                if landing.drops:
                    self.store.drop_rows(partition, landing.drops.intersection(rows))
            # the controller's encoded metadata, passed on as it came
            meta: Any = reply.meta
            packed: Any = reply.packed
            if landing.segment and self.segments is not None:
                return MetaReply(rid=rid, meta=meta, spare=self.segments.spares(), packed=packed)
            return MetaReply(rid=rid, meta=meta, packed=packed)
        finally:
            if segment:  # nothing was stored: the segment goes back to the spares
                self.segments.untake(segment)  # type: ignore[union-attr]
            self._landings.discard(landing)
            landing.done.set_result(None)
            self._release_dropped()

    def _in_flight(self, partition: str) -> list[_Landing]:
        return [x for x in self._landings if x.put.partition == partition]

    async def _fetch_landed(self, msg: Fetch, landings: list[_Landing]) -> Any:
        """Serve once the rows landed, or fail as usual once the landings that could hold them
        are over. A put waiting for room under a quota is one of them, though its rows cannot be
        in anyone's metadata yet: the wait is bounded, so that a fetch of rows that are gone
        does not hang on it."""
        waiting = {x.done for x in landings}
        deadline = asyncio.get_running_loop().time() + LANDING_WAIT
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left > 0:
                _, pending = await asyncio.wait(
                    waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                waiting = set(pending)
            try:
                return self._fetch(msg)
            except StaleRowError:
                raise
            except UnknownRowError:
                if not waiting or left <= 0:
                    raise

    def _fetch(self, msg: Fetch) -> tuple[Columns, list[Any]]:
        columns = self.store.fetch(msg.partition, msg.row_ids, msg.fields, msg.generation)
        self.served[msg.local] += sum(col.nbytes for col in columns.values())
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
                regions = self.segments.gather_segment([buffers[i - 1] for i in rest], msg.into)
            except OSError:  # e.g. /dev/shm is full: these buffers go as frames
                regions = []
            for i, region in zip(rest, regions, strict=False):
                shared[i], out[i - 1] = region, b""
            if regions and regions[0].name.startswith(f"tqs-{self.segments.token}-g"):
                # a fresh segment: its client renames it (its receive segment) once mapped
                loop = asyncio.get_running_loop()
                loop.call_later(GATHER_UNLINK_DELAY, shm.unlink, regions[0].name)
        return Columns(rid=msg.rid, columns=refs, shared=shared), out

    def handle(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        try:
            return self._handle(msg, frames)
        finally:  # before the answer: a dropped chunk's segment is gone once the drop is answered
            self._release_dropped()

    def _release_dropped(self) -> None:
        while self._dropped and self.segments is not None:
            self.segments.release(self._dropped.pop())

    def _handle(self, msg: Any, frames: list[Any]) -> Any:
        s = self.store
        match msg:
            case Store():
                return self._store(msg, frames)
            case PutRows():
                return self._put(msg, frames)
            case Fetch():
                try:
                    return self._fetch(msg)
                except StaleRowError:
                    raise  # no landing makes an earlier generation's metadata current
                except UnknownRowError:
                    landings = self._in_flight(msg.partition)
                    if not landings:
                        raise
                    return self._fetch_landed(msg, landings)
            case DropRows():
                landings = self._in_flight(msg.partition)
                if landings:
                    early = s.missing(msg.partition, msg.row_ids)
                    for x in landings:
                        x.drops.update(early)
                return Ok(rid=msg.rid, count=s.drop_rows(msg.partition, msg.row_ids))
            case DropChunks():
                s.drop_chunks(msg.chunks)
                return Ok(rid=msg.rid)
            case Publish():
                for chunk in msg.chunks:
                    s.publish(chunk)
                return Ok(rid=msg.rid)
            case DropPartition():
                for x in self._in_flight(msg.partition):
                    x.cleared_before = (
                        0 if msg.before_chunk == 0 or x.cleared_before == 0
                        else max(x.cleared_before, msg.before_chunk)
                    )  # fmt: skip
                s.drop_partition(msg.partition, msg.before_chunk)
                return Ok(rid=msg.rid)
            case SaveUnit():
                return self.checkpoints.save(msg)
            case LoadUnit():
                return self.checkpoints.load(msg)
            case ResetUnit():
                # stored puts still landing get their chunk ids from the controller, which
                # commits them only now that the unit is revived: they are younger, and stay
                s.reset(msg.before_chunk)
                return Ok(rid=msg.rid)
            case GetInventory():
                held = [HeldRows.of(*part) for part in s.inventory()]
                return InventoryReply(rid=msg.rid, partitions=held)
            case GetUnitStats():
                stats = UnitStats(
                    address=self.address,
                    bytes=s.bytes,
                    chunks=s.chunks,
                    rows=s.rows,
                    max_bytes=self.config.max_bytes,
                    spare_bytes=self.segments.spare_bytes if self.segments else 0,
                    local_bytes=self.stored[True],
                    remote_bytes=self.stored[False],
                    local_read_bytes=self.served[True],
                    remote_read_bytes=self.served[False],
                )
                return UnitStatsReply(rid=msg.rid, stats=stats)
            case _:
                raise InvalidRequestError(
                    f"{type(msg).__name__} is not a storage request; it goes to the controller"
                )


def _describe(schemas: Mapping[str, FieldSchema]) -> str:
    return "{" + ", ".join(f"{k}: {v.describe()}" for k, v in sorted(schemas.items())) + "}"
