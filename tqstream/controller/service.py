"""The controller process's event loop: one ROUTER socket, the pure state, one timer.

Requests are handled in arrival order on one asyncio loop; nothing blocks it. A ``get_meta`` that
cannot be served is parked in the state and answered when a later event (commit, release, expiry)
makes it servable, or when its deadline passes. Deadlines of every kind share one timer, re-armed
after each request at the state's earliest deadline: the loop never sleeps or polls.

The controller talks to every storage unit over a client connection of its own, to order drops
(clear, abort, expired puts) and to collect byte counts for ``stats``. That connection is also how
it watches the unit: when it drops (the process died, or missed 3 heartbeats) the unit is lost at
once; when it comes back (the same process, or a restart at the same address) the unit revives,
empty. The server tells it when a client's connection drops: what that client held (parked
requests, leases, uncommitted puts, admission slots) is given back at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from tqstream.config import ControllerConfig
from tqstream.controller.checkpoint import Checkpoints
from tqstream.controller.state import ControllerState, Effects
from tqstream.errors import InvalidRequestError, TQStreamError
from tqstream.protocol.auth import load_keys
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    AbortPut,
    Ack,
    Acquire,
    AdmissionInfo,
    AdmissionReply,
    AdmissionVersion,
    BudgetReport,
    ClearPartition,
    ClearSamples,
    ClosePartition,
    CommitPut,
    Consume,
    CountRejected,
    CreateAdmission,
    CreatePartition,
    DropChunks,
    DropPartition,
    DropRows,
    ErrorReply,
    GetByKeys,
    GetMeta,
    GetStats,
    GetUnitStats,
    KeysReply,
    ListKeys,
    ListRows,
    LoadCheckpoint,
    MetaReply,
    Ok,
    PrepareFields,
    PreparePut,
    Publish,
    PutStored,
    Registered,
    RegisterUnit,
    Release,
    ReleaseSlots,
    ResetConsumption,
    ResetUnit,
    Results,
    RowsReply,
    SaveCheckpoint,
    Slots,
    StatsReply,
    StoredReply,
    StoredResults,
    UnitStatsReply,
    UnitStopping,
    UpsertRows,
)
from tqstream.protocol.server import Responder, Server
from tqstream.protocol.transport import error_reply, shared_context
from tqstream.types import Stats, UnitStats

if TYPE_CHECKING:
    from tqstream.controller.metrics import Metrics, Sample

__all__ = ["ControllerService"]

_log = logging.getLogger("tqstream.controller")


class _StoredResults:
    """The answer to a unit's ``PutStored``: one result per put, sent once all are in (a put that
    waits for room is answered later through the effects, like a waiting ``PreparePut``)."""

    def __init__(self, responder: Responder, n: int) -> None:
        self.responder = responder
        self.results: list[StoredReply | ErrorReply | None] = [None] * n
        self.left = n

    def part(self, i: int) -> _StoredPart:
        return _StoredPart(self, i)

    def done(self, i: int, result: StoredReply | ErrorReply) -> None:
        self.results[i] = result
        self.left -= 1
        if not self.left:
            results = [r for r in self.results if r is not None]
            self.responder.reply(StoredResults(rid=self.responder.rid, results=results))


class _StoredPart:
    """One put of a ``PutStored``: answered like a request (``reply``/``fail``, see Responder)."""

    __slots__ = ("i", "owner", "rid")

    def __init__(self, owner: _StoredResults, i: int) -> None:
        self.owner, self.i, self.rid = owner, i, 0

    def reply(self, msg: Any) -> None:
        self.owner.done(self.i, msg)

    def fail(self, exc: BaseException) -> None:
        self.owner.done(self.i, error_reply(exc, "the controller failed on a stored put"))


class ControllerService:
    def __init__(
        self, config: ControllerConfig, ctx: zmq.Context[Any] | None = None, inproc: bool = False
    ) -> None:
        self.config = config
        self.ctx = ctx or shared_context()
        self.keys = load_keys(config.keys) if config.keys else None
        self.state = ControllerState(
            lease_timeout=config.lease_timeout,
            put_timeout=config.put_timeout,
            replicas=config.replicas,
            max_rows=config.max_rows,
        )
        self.metrics: Metrics | None = None
        if config.metrics_port:  # first: the socket below would stay bound if this failed
            from tqstream.controller.metrics import Metrics  # prometheus-client: only if asked

            timeout = config.storage_timeout + 5.0  # a scrape asks every unit, as stats() does
            self.metrics = Metrics(config.host, config.metrics_port, self._sample, timeout)
        try:
            self.server = Server(
                self.ctx,
                config.host,
                config.port,
                self.handle,
                name="controller",
                max_message_bytes=config.max_message_bytes,
                units=lambda: list(self.state.units.addresses),
                inproc_units=lambda: list(self.inproc_units),
                unit_shm=lambda: list(self.unit_shm),
                inproc=inproc,
                on_disconnect=self._peer_gone,
                keys=self.keys,
                cluster=secrets.token_hex(8),
            )
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        if self.metrics is not None:
            self.server.observe = self.metrics.observe
        self.units: list[Connection] = []
        self.inproc_units: list[str] = []
        self.unit_shm: list[str] = []  # each unit's shared-memory token ("" without)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping: set[int] = set()  # units that said they were told to stop
        self._started = time.monotonic()
        self.drop_failures = 0
        self.checkpoints = Checkpoints(self)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def metrics_address(self) -> str:
        """``http://HOST:PORT/metrics``, or "" without a metrics endpoint."""
        return self.metrics.address if self.metrics is not None else ""

    async def serve(self) -> None:
        if self.metrics is not None:
            self.metrics.loop = asyncio.get_running_loop()
        try:
            await self.server.serve()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for t in list(self._tasks):
            t.cancel()
        await self.server.close()
        for conn in self.units:
            conn.close()
        self.units.clear()
        if self.metrics is not None:
            metrics, self.metrics = self.metrics, None
            await metrics.aclose()

    # --- dispatch ---
    def handle(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        now = asyncio.get_running_loop().time()
        s = self.state
        s.now = max(s.now, now)
        try:
            match msg:
                case GetMeta():
                    meta, effects = s.get_meta(msg, responder, now)
                    self._apply(effects)  # a get that cannot wait fails through them
                    return None if meta is None else MetaReply(rid=msg.rid, meta=meta)
                case PreparePut():
                    return s.prepare_put(msg, now, responder)
                case PutStored():
                    results = _StoredResults(responder, len(msg.puts))
                    for i, put in enumerate(msg.puts):
                        one = results.part(i)
                        handles: list[Any] = [one]
                        try:
                            if put.pair is None:
                                stored, effects = s.put_stored(put, msg.unit, now, one)
                            else:  # answered once both copies are in (or refused)
                                stored, handles, effects = s.put_paired(put, msg.unit, now, one)
                        except TQStreamError as exc:
                            one.fail(exc)
                            continue
                        self._apply(effects)
                        if stored is not None:  # else it waits for room: answered later
                            for handle in handles:
                                handle.reply(stored)
                    return None  # answered by ``results`` once every put is
                case PrepareFields():
                    return s.prepare_fields(msg, now, responder.peer)
                case CommitPut():
                    done, effects = s.commit(msg.put_id, now)
                    orders = self._apply(effects)
                    if s.puts.status(msg.put_id) == "cleared":
                        raise s.put_error(msg.put_id)
                    reply = Ok(rid=msg.rid) if done is None else MetaReply.of(msg.rid, done)
                    # an overwrite is seen by every reader once its units have published it
                    return self._after(orders, reply) if effects.publish else reply
                case AbortPut():
                    self._apply(s.abort(msg.put_id))
                    return Ok(rid=msg.rid)
                case Ack() | Release():
                    return self._consume(msg, now)
                case Consume():
                    answers: list[Ok | ErrorReply] = []
                    for item in msg.items:  # each as if it came alone: its own answer
                        try:
                            answers.append(self._consume(item, now))
                        except TQStreamError as exc:
                            answers.append(error_reply(exc, "the controller failed on an ack"))
                    return Results(rid=msg.rid, results=answers)
                case GetByKeys():
                    meta = s.get_by_keys(
                        msg.partition, msg.keys, msg.fields, msg.row_ids, msg.missing_ok
                    )
                    return MetaReply(rid=msg.rid, meta=meta)
                case ListKeys():
                    return KeysReply(rid=msg.rid, keys=s.list_keys(msg.partition))
                case UpsertRows():
                    meta = s.upsert_rows(msg.partition, msg.keys, msg.tags, msg.create, msg.row_ids)
                    return MetaReply(rid=msg.rid, meta=meta)
                case ListRows():
                    return RowsReply(
                        rid=msg.rid, rows=s.list_rows(msg.partition, msg.fields, msg.task)
                    )
                case ResetConsumption():
                    n, effects = s.reset_consumption(msg.partition, msg.task, now)
                    self._apply(effects)
                    return Ok(rid=msg.rid, count=n)
                case CreatePartition():
                    s.create_partition(
                        msg.partition, msg.fields, msg.tasks, msg.ttl, msg.admission,
                        msg.producers, msg.replicas,
                    )  # fmt: skip
                    return Ok(rid=msg.rid)
                case ClosePartition():
                    still_open, effects = s.close_partition(msg.partition, now)
                    self._apply(effects)
                    return Ok(rid=msg.rid, count=still_open)
                case CountRejected():
                    s.count_rejected(msg.partition, msg.count)
                    return Ok(rid=msg.rid)
                case CreateAdmission():
                    s.create_admission(msg.name, msg.style, msg.config)
                    return Ok(rid=msg.rid)
                case Acquire():
                    slots = s.acquire(msg, now, responder)
                    return None if slots is None else Slots(rid=msg.rid, slot_ids=slots)
                case ReleaseSlots():
                    self._apply(s.release_slots(msg.name, msg.slot_ids, msg.outcome))
                    return Ok(rid=msg.rid)
                case AdmissionVersion():
                    self._apply(
                        s.admission_version(msg.name, msg.version, msg.recovered, msg.reset)
                    )
                    return Ok(rid=msg.rid)
                case AdmissionInfo():
                    state, capacity = s.admission_info(msg.name, msg.version, msg.enqueued)
                    return AdmissionReply(rid=msg.rid, state=state, capacity=capacity)
                case BudgetReport():
                    state = s.budget_report(msg, responder)
                    capacity = None if msg.version is None else int(state["capacity"])
                    return AdmissionReply(rid=msg.rid, state=state, capacity=capacity)
                case ClearSamples():
                    n = len(msg.row_ids)
                    return self._drain(msg.rid, s.clear_samples(msg.partition, msg.row_ids), n)
                case ClearPartition():
                    existed = int(msg.partition in s.partitions)
                    return self._drain(msg.rid, s.clear_partition(msg.partition), existed)
                case GetStats():
                    return self._stats(msg.rid, msg.partition)
                case RegisterUnit():
                    return self._register(msg.rid, msg.address, msg.max_bytes, msg.inproc, msg.shm)
                case UnitStopping():
                    self._stopping.add(msg.unit)
                    return Ok(rid=msg.rid, count=1)
                case SaveCheckpoint():
                    return self.checkpoints.save(msg)
                case LoadCheckpoint():
                    return self.checkpoints.load(msg)
                case _:
                    raise InvalidRequestError(
                        f"{type(msg).__name__} is not a controller request; it goes to a "
                        f"storage unit"
                    )
        finally:
            self._rearm()

    def _consume(self, msg: Ack | Release, now: float) -> Ok:
        s = self.state
        if isinstance(msg, Ack):
            n, effects = s.ack(msg.partition, msg.task, msg.lease_id, msg.row_ids,
                               msg.tokens_masked, msg.resumed)  # fmt: skip
        else:
            n, effects = s.release(msg.partition, msg.task, msg.lease_id, msg.row_ids, now)
        self._apply(effects)
        return Ok(rid=msg.rid, count=n)

    # --- effects ---
    def _apply(self, effects: Effects) -> list[asyncio.Task[Any]]:
        """Answer parked requests now; start the storage drops and return their tasks."""
        for responder, meta in effects.served:
            responder.reply(MetaReply(rid=responder.rid, meta=meta))
        for responder, exc in effects.failed:
            responder.fail(exc)
        for responder, reply in effects.replies:
            responder.reply(msgspec.structs.replace(reply, rid=responder.rid))
        jobs: list[tuple[int, Any]] = []
        for unit, before in effects.reset_units:
            jobs.append((unit, ResetUnit(rid=0, before_chunk=before)))
        for unit, parts in effects.drop_rows.items():
            for partition, rows in parts.items():
                jobs.append((unit, DropRows(rid=0, partition=partition, row_ids=rows)))
        for unit, chunks in effects.drop_chunks.items():
            jobs.append((unit, DropChunks(rid=0, chunks=chunks)))
        for unit, chunks in effects.publish.items():
            jobs.append((unit, Publish(rid=0, chunks=chunks)))
        for partition, before in effects.drop_partitions:
            order = DropPartition(rid=0, partition=partition, before_chunk=before)
            jobs.extend((u, order) for u in range(len(self.units)))
        alive = self.state.units.alive
        # a lost unit's bytes are gone with it; a revived one drops them with its ResetUnit
        return [self._spawn(self._order(u, req)) for u, req in jobs if alive[u]]

    async def _order(self, unit: int, req: Any) -> None:
        try:
            await self.units[unit].request(req, timeout=self.config.storage_timeout)
        except TQStreamError as exc:
            self.drop_failures += 1
            if self.state.units.alive[unit]:  # else the unit died since: nothing to free there
                _log.warning(
                    "storage unit %d at %s did not free storage (%s): %s",
                    unit, self.state.units.addresses[unit], type(req).__name__, exc,
                )  # fmt: skip
                raise

    def _drain(self, rid: int, effects: Effects, count: int) -> Any:
        """Reply only once the storage units have freed the bytes (so stats are exact after)."""
        return self._after(self._apply(effects), Ok(rid=rid, count=count))

    @staticmethod
    async def _after(tasks: list[asyncio.Task[Any]], reply: Any) -> Any:
        """``reply`` once the storage units carried out ``tasks`` (their failures propagate)."""
        await asyncio.gather(*tasks)
        return reply

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name="tqstream-controller-order")
        self._tasks.add(task)
        task.add_done_callback(self._order_done)
        return task

    def _order_done(self, task: asyncio.Task[Any]) -> None:
        """A drop order that failed is counted (``drop_failures``); one a clear waits for fails
        that clear (see ``_drain``), the others have nobody to tell."""
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" noise

    # --- faults ---
    def _event(self, change: Any) -> None:
        """Apply a state change made outside a request (a unit or a peer went away)."""
        now = asyncio.get_running_loop().time()
        s = self.state
        s.now = max(s.now, now)
        try:
            self._apply(change(now))
        finally:
            self._rearm()

    def _peer_gone(self, peer: bytes) -> None:
        self._event(lambda now: self.state.drop_peer(peer, now))

    def _unit_down(self, unit: int) -> None:
        before = self._lost_rows()
        self._event(lambda now: self.state.lose_unit(unit, now))
        lost = self._lost_rows() - before
        address = self.state.units.addresses[unit]
        if unit in self._stopping:  # it said it was told to stop: a shutdown, not a fault
            self._stopping.discard(unit)
            _log.info(
                "storage unit %d at %s stopped (it was shut down); %d rows only it held went "
                "with it (counted as lost in stats)",
                unit, address, lost,
            )  # fmt: skip
            return
        _log.log(
            logging.WARNING if lost else logging.INFO,
            "storage unit %d at %s is lost (its connection dropped); %d rows had no other copy "
            "and are counted lost; new rows go to the other units",
            unit, address, lost,
        )  # fmt: skip

    def _unit_up(self, unit: int) -> None:
        self._event(lambda now: self.state.revive_unit(unit))
        _log.warning(
            "storage unit %d at %s is reachable again; it serves again, empty",
            unit, self.state.units.addresses[unit],
        )  # fmt: skip

    def _lost_rows(self) -> int:
        return sum(p.lost for p in self.state.partitions.values())

    # --- time ---
    def _rearm(self) -> None:
        at = self.state.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = asyncio.get_running_loop().call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._apply(self.state.expire(asyncio.get_running_loop().time()))
        self._rearm()

    async def _sample(self) -> Sample:
        """What a metrics scrape exports (docs/observability.md)."""
        from tqstream.controller.metrics import Sample

        assert self.metrics is not None
        reply = await self._stats(0, None)
        return Sample(reply.stats, self.state, self.server, self.drop_failures, self.metrics)

    # --- units and stats ---
    def _add_unit(self, address: str, max_bytes: int) -> int:
        unit, effects = self.state.add_unit(address, max_bytes)
        self._apply(effects)  # a lost unit registering again: it drops what it held
        return unit

    async def _register(
        self, rid: int, address: str, max_bytes: int, inproc: str, shm: str
    ) -> Registered:
        if address in self.state.units.addresses:  # a restarted unit, or a repeated register
            unit = self._add_unit(address, max_bytes)
            self.unit_shm[unit] = shm  # a restarted unit's segments have a new token
            return Registered(rid=rid, unit=unit)
        conn = await Connection.open(
            self.ctx,
            inproc or address,
            role="controller",
            connect_timeout=self.config.connect_timeout,
            heartbeat_interval=self.config.heartbeat_interval,
            max_message_bytes=self.config.max_message_bytes,
            keys=self.keys,
        )
        if address in self.state.units.addresses:  # registered twice at once: keep the first
            conn.close()
            unit = self._add_unit(address, max_bytes)
            self.unit_shm[unit] = shm
            return Registered(rid=rid, unit=unit)
        unit = self._add_unit(address, max_bytes)
        assert unit == len(self.units)
        _log.info("storage unit %d registered at %s", unit, address)
        conn.on_down = lambda: self._unit_down(unit)
        conn.on_up = lambda: self._unit_up(unit)
        self.units.append(conn)
        self.inproc_units.append(inproc)
        self.unit_shm.append(shm)
        return Registered(rid=rid, unit=unit)

    async def _stats(self, rid: int, partition: str | None) -> StatsReply:
        parts = self.state.stats(partition)

        async def one(i: int, conn: Connection) -> UnitStats:
            if not self.state.units.alive[i]:
                return UnitStats(
                    address=self.state.units.addresses[i], bytes=0, chunks=0, rows=0, alive=False
                )
            try:
                reply, _ = await conn.request(
                    GetUnitStats(rid=0), timeout=self.config.storage_timeout
                )
                assert isinstance(reply, UnitStatsReply)
                return reply.stats
            except TQStreamError:
                return UnitStats(
                    address=self.state.units.addresses[i], bytes=-1, chunks=-1, rows=-1,
                    alive=False,
                )  # fmt: skip

        units = await asyncio.gather(*(one(i, c) for i, c in enumerate(self.units)))
        stats = Stats(
            partitions=parts, units=list(units), admissions=self.state.admission_stats(),
            uptime=time.monotonic() - self._started,
        )  # fmt: skip
        return StatsReply(rid=rid, stats=stats)
