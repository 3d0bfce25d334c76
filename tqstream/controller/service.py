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
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from tqstream.config import ControllerConfig
from tqstream.controller import links, recovery
from tqstream.controller.checkpoint import Checkpoints
from tqstream.controller.durable import (
    EXPIRE,
    PEER_GONE,
    UNIT_DOWN,
    UNIT_UP,
    Durable,
    Later,
    Tracked,
    journaled,
)
from tqstream.controller.state import ControllerState, Effects
from tqstream.controller.stored import Stored
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
    UnitStopping,
    UpsertRows,
)
from tqstream.protocol.server import Responder, Server
from tqstream.protocol.transport import error_reply, shared_context

if TYPE_CHECKING:
    from tqstream.controller.metrics import Metrics, Sample

__all__ = ["ControllerService"]

_log = logging.getLogger("tqstream.controller")
_RETRY = 5.0  # seconds between snapshots tried while the journal is degraded


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
        self.durable: Durable | None = None
        if config.durability != "off":  # opened first: it says which cluster this is
            self.durable = Durable(config.journal, config.durability, config.fsync_interval,
                                   config.snapshot_records)  # fmt: skip
        # the wall clock, read through the loop's: deadlines mean the same in a restarted process
        self._skew = time.time() - time.monotonic()
        self._replay_now: float | None = None  # the time of the record being replayed
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
                inproc_units=lambda: [link.inproc for link in self.links],
                unit_shm=lambda: [link.shm for link in self.links],
                inproc=inproc,
                on_disconnect=self._peer_gone,
                keys=self.keys,
                cluster=secrets.token_hex(8) if self.durable is None else self.durable.cluster,
                journal=None if self.durable is None else self.durable.journal,
            )
            if self.durable is not None:
                self.durable.journal.on_degraded = self._degraded
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            if self.durable is not None:
                self.durable.close()
            raise
        if self.metrics is not None:
            self.server.observe = self.metrics.observe
        self.links: list[links.UnitLink] = []  # storage unit i's is links[i]
        self._orders: list[tuple[int, Any]] | None = None  # drop orders held while replaying
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping: set[int] = set()  # units that said they were told to stop
        self._started = time.monotonic()
        self._closing = False
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
            if self.durable is not None and self.durable.to_replay is not None:
                await self._recover()
            await self.server.serve()
        finally:
            await self.close()

    def _clock(self) -> float:
        """Now, on the wall clock (the time of the record being replayed, while replaying)."""
        if self._replay_now is not None:
            return self._replay_now
        return asyncio.get_running_loop().time() + self._skew

    @property
    def server_closed(self) -> bool:
        return self._closing

    async def close(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        for t in list(self._tasks):
            t.cancel()
        await self.server.close()
        for link in self.links:
            if link.conn is not None:  # None: a start that failed while replaying its journal
                link.conn.close()
        self.links.clear()
        if self.metrics is not None:
            metrics, self.metrics = self.metrics, None
            await metrics.aclose()
        if self.durable is not None:
            self.durable.close()

    # --- dispatch ---
    def handle(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        d = self.durable
        if d is None or not journaled(msg):
            return self._handle(msg, responder, self._clock())
        key = (responder.peer, msg.rid)
        if d.answers.seen(key, responder):  # sent again: answered as the first time
            return None
        now = self._clock()
        d.request(now, responder.peer, msg.rid, frames[0].buffer)
        tracked = Tracked(responder, d.answers)
        d.answers.start(key, tracked)
        started = time.perf_counter()
        try:
            result = self._handle(msg, tracked, now)
        except BaseException:
            d.answers.forget(key)  # it changed nothing: sent again, it runs again
            raise
        finally:
            d.worked(time.perf_counter() - started)
        if isinstance(result, Later):
            d.answers.promise(key, result.reply)
        if inspect.isawaitable(result):
            result = self._kept(key, result)
        elif result is not None:
            d.answers.done(key, result[0] if isinstance(result, tuple) else result)
        if d.due():  # after the answer is kept: a snapshot must not forget it
            self._snapshot()
        return result

    async def _kept(self, key: Any, work: Any) -> Any:
        """A reply that comes later, kept for a request sent again."""
        assert self.durable is not None
        try:
            result = await work
        except BaseException:
            self.durable.answers.forget(key)
            raise
        self.durable.answers.done(key, result[0] if isinstance(result, tuple) else result)
        return result

    def _handle(self, msg: Any, responder: Any, now: float) -> Any:
        s = self.state
        if self.durable is None or journaled(msg):  # a read leaves the state as it is: a replay
            s.now = max(s.now, now)  # does not see it
        try:
            match msg:
                case GetMeta():
                    meta, effects = s.get_meta(msg, responder, now)
                    self._apply(effects)  # a get that cannot wait fails through them
                    return None if meta is None else MetaReply(rid=msg.rid, meta=meta)
                case PreparePut():
                    return s.prepare_put(msg, now, responder)
                case PutStored():
                    results = Stored(responder, len(msg.puts))
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
                    return self._register(msg)
                case UnitStopping():
                    self._stopping.add(msg.unit)
                    return Ok(rid=msg.rid, count=1)
                case SaveCheckpoint():
                    return self.checkpoints.save(msg)
                case LoadCheckpoint():
                    return self.checkpoints.load(msg, getattr(responder, "key", None))
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
            jobs.extend((u, order) for u in range(len(self.links)))
        if self._orders is not None:  # replaying: sent once the units are connected
            self._orders.extend(jobs)
            return []
        alive = self.state.units.alive
        # a lost unit's bytes are gone with it; a revived one drops them with its ResetUnit
        return [self._spawn(self._order(u, req)) for u, req in jobs if alive[u]]

    async def _order(self, unit: int, req: Any) -> None:
        try:
            await self.links[unit].request(req, self.config.storage_timeout)
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
    def _after(tasks: list[asyncio.Task[Any]], reply: Any) -> Later:
        return Later(tasks, reply)

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
    def _event(self, change: Any, kind: int = 0, *record: Any) -> None:
        """Apply a state change made outside a request (a unit or a peer went away), journaled
        as ``kind`` with ``record`` after the time."""
        now = self._clock()
        if self.durable is not None and kind:
            self.durable.event(kind, now, *record)
        s = self.state
        s.now = max(s.now, now)
        try:
            self._apply(change(now))
        finally:
            self._rearm()

    def _peer_gone(self, peer: bytes) -> None:
        if self.durable is not None:
            self.durable.peers.discard(peer)
        self._event(lambda now: self.state.drop_peer(peer, now), PEER_GONE, peer)

    def _unit_down(self, unit: int) -> None:
        before = self._lost_rows()
        self._event(lambda now: self.state.lose_unit(unit, now), UNIT_DOWN, unit)
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
        self._event(lambda now: self.state.revive_unit(unit), UNIT_UP, unit)
        _log.warning(
            "storage unit %d at %s is reachable again; it serves again, empty",
            unit, self.state.units.addresses[unit],
        )  # fmt: skip

    def _lost_rows(self) -> int:
        return sum(p.lost for p in self.state.partitions.values())

    # --- time ---
    def _rearm(self) -> None:
        if self._orders is not None:  # replaying: armed once done
            return
        at = self.state.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = asyncio.get_running_loop().call_at(at - self._skew, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        now = self._clock()
        if self.durable is not None:
            self.durable.event(EXPIRE, now)
        self._apply(self.state.expire(now))
        self._rearm()

    async def _sample(self) -> Sample:
        """What a metrics scrape exports (docs/observability.md)."""
        from tqstream.controller.metrics import Sample

        assert self.metrics is not None
        reply = await self._stats(0, None)
        journal = None if self.durable is None else self.durable.journal
        return Sample(
            reply.stats, self.state, self.server, self.drop_failures, self.metrics, journal
        )

    # --- units and stats ---
    def _add_unit(
        self, address: str, max_bytes: int, inproc: str, shm: str, boot: str,
        conn: Connection | None = None,
    ) -> int:  # fmt: skip
        return links.add_unit(self, address, max_bytes, inproc, shm, boot, conn)

    def _register(self, msg: RegisterUnit) -> Awaitable[Registered]:
        return links.register(self, msg)

    def _stats(self, rid: int, partition: str | None) -> Awaitable[StatsReply]:
        return links.stats(self, rid, partition)

    # --- durability ---
    async def _recover(self) -> None:
        await recovery.recover(self)

    def _snapshot(self) -> asyncio.Task[bool]:
        """Write a snapshot of the state: a restart replays the journal from here."""
        assert self.durable is not None
        units = [(link.inproc, link.shm, link.boot) for link in self.links]
        return self.durable.snapshot({"state": self.state, "units": units})

    def _degraded(self, reason: str) -> None:
        """The journal cannot write: try a snapshot again every few seconds until one lands."""
        _log.error(
            "the controller's journal is degraded (%s): it keeps serving, but what it tells "
            "clients is not durable until a snapshot lands; retrying one every %gs",
            reason, _RETRY,
        )  # fmt: skip
        asyncio.get_running_loop().call_later(_RETRY, self._retry_snapshot)

    def _retry_snapshot(self) -> None:
        if self.durable is None or self.durable.journal.degraded is None or self.server_closed:
            return
        if not self.durable.journal.rebasing:
            self._snapshot().add_done_callback(self._retried)
        else:
            asyncio.get_running_loop().call_later(_RETRY, self._retry_snapshot)

    def _retried(self, task: asyncio.Task[bool]) -> None:
        if task.cancelled() or task.exception() is not None or not task.result():
            asyncio.get_running_loop().call_later(_RETRY, self._retry_snapshot)
        else:
            _log.warning("the controller's journal is whole again (a snapshot landed)")

    async def _loaded(self, key: Any = None, reply: Any = None) -> None:
        """A checkpoint was loaded into the state: a snapshot stands for it (a restart does
        not load it again; the request ``key`` sent again gets ``reply``)."""
        if self.durable is not None:
            if reply is not None:
                self.durable.answers.promise(key, reply)
            await self._snapshot()
