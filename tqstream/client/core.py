"""The client's protocol logic, running on the client's IO loop (see ``client.py``).

One connection to the controller and one per storage unit, opened lazily and kept for the client's
life. A put under ``direct_put_bytes`` is one ``PutRows`` to the next storage unit in turn, which
holds the columns and has the controller commit them (``storage/service.py``); its bytes are one
packed frame, or a shared-memory segment the unit takes over (``protocol/shm.py``); a client that
dies mid-put leaves either a committed put or nothing. A larger put is: ``PreparePut`` at the
controller (validation, keys, placement) → one ``Store`` per storage unit, concurrently, each
carrying one contiguous chunk per field → ``CommitPut``. If
anything fails after the prepare — a unit error, a timeout, a cancelled caller — the client sends
``AbortPut`` so the controller rolls the rows back and orders the units to drop what arrived; if
the client itself dies, the controller's ``put_timeout`` does the same.

With a storage unit on the same host (and ``shared_memory="auto"``) the tensor bytes of a ``Store``
and a ``Fetch`` go through shared memory (``protocol/shm.py``) and the messages carry only headers.

A partition that keeps two copies of each row has every chunk stored on two units (the plan names
the replica); a fetch from a unit that is gone reads the rows' replicas instead, and without a
replica fails with ``UnitLostError`` naming the unit and the rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import torch
import zmq

from tqstream.client import coalesce
from tqstream.client.deferred import Deferred, encoded
from tqstream.config import ClientConfig
from tqstream.errors import (
    ClosedError,
    ConnectError,
    ConnectionLostError,
    InternalError,
    InvalidRequestError,
    PlacementRequiredError,
    RequestTimeoutError,
    TQStreamError,
    UnitLostError,
    UnknownRowError,
)
from tqstream.protocol import shm
from tqstream.protocol.auth import Keys, load_keys
from tqstream.protocol.columns import Column
from tqstream.protocol.connection import Connection, another_cluster, not_a_controller
from tqstream.protocol.messages import (
    PROTOCOL_VERSION,
    AbortPut,
    Ack,
    ClearPartition,
    ClearSamples,
    Columns,
    CommitPut,
    Consume,
    CountRejected,
    ErrorReply,
    Fetch,
    FieldsPlan,
    GetByKeys,
    GetMeta,
    GetStats,
    Hello,
    KeysReply,
    ListKeys,
    MetaReply,
    Ok,
    Pair,
    PrepareFields,
    PreparePut,
    PutPlan,
    PutRows,
    Region,
    Release,
    Results,
    Spare,
    StatsReply,
    Store,
    Welcome,
)
from tqstream.protocol.parts import joined, nbytes
from tqstream.protocol.transport import context, error_from_reply
from tqstream.protocol.wire import column_from_wire, columns_to_wire
from tqstream.types import BatchMeta, Stats

T = TypeVar("T")

CLOSED_DURING = "the client closed before the request was answered"

GET_GRACE = 10.0
"""Extra seconds a client waits for a parked get beyond its server-side timeout."""


def _shared_frames(token: str, shared: Mapping[int, Region], frames: list[Any]) -> list[Any]:
    """The reply's frames with the shared ones replaced by views of the unit's segments."""
    segments = shm.Segments(token, missing=UnknownRowError)
    out: list[Any] = list(frames)
    for i, region in shared.items():
        if not 1 <= i < len(out):
            raise InternalError(f"the storage unit's reply puts frame {i} in shared memory, "
                                f"but has frames 1..{len(out) - 1}")  # fmt: skip
        out[i] = segments.view(region)
    return out


def read_near(meta: BatchMeta, near: set[int]) -> BatchMeta:
    """``meta`` with the rows whose copy is on this host (a unit of ``near``) and first unit is
    not read from the copy; the first unit becomes their fallback."""
    swap = [u not in near and r in near for u, r in zip(meta.units, meta.replicas, strict=True)]
    if not any(swap):
        return meta
    units = [r if s else u for u, r, s in zip(meta.units, meta.replicas, swap, strict=True)]
    copies = [u if s else r for u, r, s in zip(meta.units, meta.replicas, swap, strict=True)]
    return msgspec.structs.replace(meta, units=units, replicas=copies)


def _by_unit(units: Sequence[int], positions: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for u, i in zip(units, positions, strict=True):
        out.setdefault(u, []).append(i)
    return out


def _primary(meta: BatchMeta) -> BatchMeta:
    """``meta`` read from the replicas: no second fallback."""
    return msgspec.structs.replace(meta, replicas=[])


async def _all(jobs: Sequence[Awaitable[T]]) -> list[T]:
    """``asyncio.gather``, without its task per job when there is one job (most puts and gets:
    one storage unit), which saves loop iterations on the small-request path."""
    if len(jobs) == 1:
        return [await jobs[0]]
    return list(await asyncio.gather(*jobs))


class ClientCore:
    def __init__(
        self,
        ctx: zmq.Context[Any],
        controller: Connection,
        config: ClientConfig,
        owns_ctx: bool,
        keys: Keys | None = None,
    ) -> None:
        self.ctx = ctx
        self._owns_ctx = owns_ctx
        self.config = config
        self.keys = keys
        self.controller = controller
        self.unit_addresses: list[str] = self._addresses(controller.welcome)
        # units on this host (their shared memory reached), and those puts go to first (the same,
        # unless ClientConfig.locality is "off")
        self.hosted: set[int] = self._hosted(controller.welcome)
        self.near = self.hosted if config.locality == "host" else set()
        self._units: dict[int, asyncio.Task[Connection]] = {}
        self._shm: dict[int, str] = {}  # unit -> token, for units reachable through shared memory
        self._spares: dict[int, list[Spare]] = {}  # unit -> its recycled segments, last we heard
        self._stale: set[int] = set()  # units reconnected since their Welcome (maybe restarted)
        self._writer = shm.Writer()  # large segments' mappings kept for the next puts
        self._receivers: dict[int, shm.Receiver] = {}  # unit -> where its gathered rows go
        self._background: set[asyncio.Task[None]] = set()
        self.release_elsewhere: Callable[[BatchMeta], None] | None = None
        """Set on a core whose loop runs only during calls: where ``release_soon`` sends leases
        to release (a loop that keeps running)."""
        self._wake: int | None = None
        self._turn = random.randrange(1 << 16)  # the unit of the next direct put, modulo units
        self._skip: dict[int, float] = {}  # unit -> until when direct puts avoid it (unreachable)
        self._placed: set[str] = set()  # partitions whose puts the controller must place
        self._paired: set[str] = set()  # partitions of two copies: one-exchange puts go in pairs
        self._coalescing: dict[Hashable, list[coalesce.Pending]] = {}  # puts about to be sent
        self._flights = coalesce.Flights(config.coalesce_rejoin)  # coalesced puts in flight
        self._consuming: list[tuple[Ack | Release, asyncio.Future[int]]] | None = None  # acks

    @classmethod
    async def open(
        cls,
        address: str,
        config: ClientConfig,
        ctx: zmq.Context[Any] | None = None,
        session: bytes = b"",
        cluster: str = "",
    ) -> ClientCore:
        """Connect to the controller at ``address``; ``ctx``, when given, is the embedded
        servers' context (needed for ``inproc://`` addresses) and stays open at close.
        ``session``: the client this core belongs to (shared by its lanes' cores; see
        ``Hello.session``). ``cluster``: the cluster its first core reached (``Welcome.cluster``;
        "" at the first): a controller of another one at ``address`` is refused."""
        keys = load_keys(config.keys) if config.keys else None
        own = context() if ctx is None else None
        try:
            conn = await cls._connect(own or ctx, address, config, keys, session)  # type: ignore[arg-type]
            if conn.welcome.server != "controller":
                conn.close()
                raise not_a_controller(address, conn.welcome)
            if cluster and conn.welcome.cluster != cluster:
                conn.close()
                raise another_cluster(address, conn.welcome.cluster, cluster)
            # a controller with a journal is restarted if it dies: wait for it, and send the
            # requests in flight again (it answers each once)
            conn.resend = conn.welcome.durable
            conn.reconnect_timeout = config.reconnect_timeout
        except BaseException:
            if own is not None:
                own.destroy(linger=0)
            raise
        return cls(own or ctx, conn, config, own is not None, keys)  # type: ignore[arg-type]

    def _addresses(self, welcome: Welcome) -> list[str]:
        """The units' addresses; their inproc ones when we reached the controller in-process."""
        if not self.controller.address.startswith("inproc://"):
            return list(welcome.units)
        local = welcome.inproc_units
        return [
            (local[i] if i < len(local) and local[i] else a) for i, a in enumerate(welcome.units)
        ]

    @staticmethod
    def _hosted(welcome: Welcome) -> set[int]:
        """The units whose shared memory this process reaches: on its host."""
        return {i for i, token in enumerate(welcome.unit_shm) if shm.reachable(token)}

    @staticmethod
    async def _connect(
        ctx: zmq.Context[Any],
        address: str,
        config: ClientConfig,
        keys: Keys | None,
        session: bytes = b"",
    ) -> Connection:
        return await Connection.open(
            ctx,
            address,
            session=session,
            connect_timeout=config.connect_timeout,
            heartbeat_interval=config.heartbeat_interval,
            max_message_bytes=config.max_message_bytes,
            keys=keys,
        )

    def _opened(self) -> dict[int, Connection]:
        """The unit connections whose opening succeeded."""
        return {
            index: task.result()
            for index, task in self._units.items()
            if task.done() and not task.cancelled() and task.exception() is None
        }

    def close(self) -> None:
        """Close every connection (pending requests fail with ``ClosedError``); call on the
        core's loop thread, or while nothing runs on its loop."""
        opened = self._opened()
        for index, task in self._units.items():
            if index in opened:
                opened[index].close()
            else:
                task.cancel()
        self._units.clear()
        self._writer.close()
        for receiver in self._receivers.values():
            receiver.close()
        self._receivers.clear()
        self.controller.close()
        if self._owns_ctx:
            self.ctx.destroy(linger=0)

    def move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on ``loop`` from now on (call on it): the loop the core ran on is closed."""
        self.controller.move_to(loop)
        opened = self._opened()
        for index in list(self._units):
            if index in opened:
                opened[index].move_to(loop)
            else:  # an open cut short when the old loop closed: open again when needed
                del self._units[index]
        self._background.clear()

    def wake_with(self, fd: int) -> None:
        """Requests waiting without a running loop end when ``fd`` becomes readable (see
        ``Connection.wake``)."""
        self._wake = self.controller.wake = fd
        for conn in self._opened().values():
            conn.wake = fd

    def check_links(self) -> None:
        """Take in the connection events that queued while the loop was not running (a core
        driven only during calls), so a request is not failed for a drop that is already over."""
        self.controller.check_link()
        for conn in self._opened().values():
            conn.check_link()

    async def _unit(self, index: int) -> Connection:
        task = self._units.get(index)
        if task is None or (task.done() and task.exception() is not None):
            task = self._units[index] = asyncio.get_running_loop().create_task(
                self._open_unit(index), name=f"tqstream-client-open-unit-{index}"
            )
        conn = await asyncio.shield(task)
        if index in self._stale:  # dropped since its Welcome: ask whose shared memory it is now
            self._stale.discard(index)
            try:
                hello = Hello(rid=0, protocol=PROTOCOL_VERSION)
                self._learn_shm(index, await self._ask(hello, Welcome, conn=conn))
            except BaseException:
                self._stale.add(index)  # ask again next time
                raise
        return conn

    async def _open_unit(self, index: int) -> Connection:
        if index >= len(self.unit_addresses):  # a unit that registered after we connected
            welcome = await self._ask(Hello(rid=0, protocol=PROTOCOL_VERSION), Welcome)
            self.unit_addresses = self._addresses(welcome)
            self.hosted = self._hosted(welcome)
            self.near = self.hosted if self.config.locality == "host" else set()
        if index >= len(self.unit_addresses):
            raise InternalError(
                f"the controller placed rows on storage unit {index}, but knows "
                f"only {len(self.unit_addresses)} units"
            )
        conn = await self._connect(self.ctx, self.unit_addresses[index], self.config, self.keys)
        conn.wake = self._wake
        self._learn_shm(index, conn.welcome)
        # the unit may come back as a new process (restarted at its address) with a new token:
        # the next request to it asks its Welcome first (``_unit``)
        conn.on_down = conn.on_up = lambda: self._stale.add(index)
        return conn

    def _learn_shm(self, index: int, welcome: Welcome) -> None:
        token = welcome.shm
        if self.config.shared_memory != "auto" or not shm.reachable(token):
            token = ""
        if token != self._shm.get(index, ""):
            self._spares.pop(index, None)  # another process's (or none)
        if token:
            self._shm[index] = token
        else:
            self._shm.pop(index, None)

    async def _ask(
        self,
        msg: Any,
        expect: type | tuple[type, ...],
        *,
        conn: Connection | None = None,
        buffers: Sequence[Any] = (),
        timeout: float | None = -1.0,
    ) -> Any:
        if timeout == -1.0:
            timeout = self.config.request_timeout
        reply, frames = await (conn or self.controller).request(msg, buffers, timeout=timeout)
        if not isinstance(reply, expect):
            wanted = " or ".join(
                t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,))
            )
            raise InternalError(
                f"expected {wanted} in reply to {type(msg).__name__}, got {type(reply).__name__}"
            )
        if expect is Columns:
            return reply, frames
        return reply

    def _token(self, unit: int) -> str:
        """The unit's shared-memory token, "" when bytes go as frames (call after ``_unit``)."""
        return self._shm.get(unit, "")

    # --- writes ---
    async def put(
        self,
        req: PreparePut,
        columns: dict[str, Column] | Deferred,
        coalesce: bool = True,
        caller: Hashable = None,
    ) -> BatchMeta:
        """Store a put's rows; with ``coalesce`` (and ``coalesce_window`` not None) together with
        the puts issued with it (``coalesce.py``), its columns encoded with theirs if they are
        not yet (``deferred.py``). ``caller``: the task or thread making it, whose next put
        the coalesced puts after this one may wait for (``coalesce.Flights``)."""
        partition = req.partition
        if req.n_rows == 0:  # every row was rejected: count them, store nothing
            await self._ask(CountRejected(rid=0, partition=partition, count=req.rejected), Ok)
            return BatchMeta(partition, [], [], [], [], [], [], list(req.schemas), {},
                             rejected=req.rejected)  # fmt: skip
        direct = req.nbytes < self.config.direct_put_bytes and self.unit_addresses
        if direct and partition not in self._placed:
            if coalesce and self.config.coalesce_window is not None and req.shapes is None:
                return await self._coalesced(req, columns, caller)
            return await self._put_one(*encoded(req, columns))
        return await self._put_placed(*encoded(req, columns))

    async def _put_one(self, req: PreparePut, columns: dict[str, Column]) -> BatchMeta:
        """A put in one exchange (to two units for a partition of two copies), or placed by the
        controller when it must be (a full unit; it grew to ``direct_put_bytes`` by coalescing;
        fewer than two units for two copies)."""
        if req.partition not in self._placed and req.nbytes < self.config.direct_put_bytes:
            wait = None if req.timeout is None else req.timeout + GET_GRACE
            try:
                if req.partition in self._paired:
                    return await self._put_pair(req, columns, wait)
                return await self._put_direct(req, columns, wait)
            except PlacementRequiredError as exc:  # refused before anything was stored
                copies = exc.details.get("replicas")
                if (copies == 2) != (req.partition in self._paired):  # learnt, or re-created
                    if copies == 2:  # two copies: all of its puts go in pairs
                        self._paired.add(req.partition)
                    else:
                        self._paired.discard(req.partition)
                    return await self._put_one(req, columns)
                # else a full unit, or fewer than two units for two copies: this put is placed
        return await self._put_placed(req, columns)

    async def _put_pair(
        self, req: PreparePut, columns: dict[str, Column], wait: float | None
    ) -> BatchMeta:
        """A put to a partition of two copies in one exchange: the rows go to two units at once,
        each of which has the controller commit them; it commits once both hold them (the first
        unit's rows, the second's their copy), and both answer with the same rows. If either
        answers with the rows, the put is made (the other's failure, e.g. its unit dying after
        the commit, loses no row: the controller keeps the copy it has)."""
        units = self._pair_units()
        if units is None:
            raise PlacementRequiredError(
                "fewer than two storage units are reachable for a put of two copies: the "
                "controller places it",
                partition=req.partition,
            )
        req = msgspec.structs.replace(req, pair=Pair(token=secrets.randbits(62) + 1, units=units))
        legs = await asyncio.gather(
            *(self._put_direct(req, columns, wait, unit) for unit in units),
            return_exceptions=True,
        )
        for leg in legs:
            if isinstance(leg, BatchMeta):
                return leg
        errors = [leg for leg in legs if isinstance(leg, BaseException)]
        for exc in errors:  # the controller's answer (a refusal) says more than a lost link
            if isinstance(exc, TQStreamError) and not isinstance(exc, UnitLostError):
                raise exc
        raise errors[0]

    def _pair_units(self) -> list[int] | None:
        """The two units of a put of two copies: the next in turn (of this host first), and the
        next reachable unit after it."""
        first = self._direct_unit()
        n, now = len(self.unit_addresses), time.monotonic()
        for k in range(1, n):
            unit = (first + k) % n
            if self._skip.get(unit, 0.0) <= now and not self._is_down(unit):
                return [first, unit]
        return None

    async def _coalesced(
        self, req: PreparePut, columns: dict[str, Column] | Deferred, caller: Hashable
    ) -> BatchMeta:
        """Send the put with the others issued with it (``coalesce.py``); its own rows back. The
        first put of a merge key waits a loop turn (or the window) for the others to join, while
        puts of its key are in flight to every unit they go to, for one of them to end, and then
        for the callers of those that ended to put again when they do that quickly; then it
        sends them all."""
        loop = asyncio.get_running_loop()
        key = coalesce.merge_key(req)
        answer: asyncio.Future[BatchMeta] = loop.create_future()
        mine = coalesce.Pending(req, columns, answer, caller)
        self._flights.issued(key, caller)
        waiting = self._coalescing.get(key)
        if waiting is not None:  # the first one sends it
            waiting.append(mine)
            return await answer
        self._coalescing[key] = [mine]
        try:
            await asyncio.sleep(self.config.coalesce_window or 0.0)
            await self._flights.below(key, self._units_in_turn())
            await self._flights.rejoined(key, len(self._coalescing[key]))
        except BaseException:
            answer.cancel()  # cancelled before anything was sent: this put is not made
            raise
        finally:
            # a caller cancelled meanwhile has no put made either; the others are sent by tasks
            # of their own, so that no caller's cancellation cancels another's put
            puts = [p for p in self._coalescing.pop(key) if not p.answer.done()]
            if len(puts) > 1 or (puts and puts[0] is not mine):
                for batch in coalesce.batches(puts):
                    task = loop.create_task(self._put_batch(key, batch))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
        if len(puts) == 1 and puts[0] is mine:
            with self._flights.flying(key, (caller,)):
                return await self._put_one(*encoded(req, columns))
        return await answer

    def _units_in_turn(self) -> int:
        """How many puts of one merge key may be in flight before the next ones wait to go
        together: one per unit that one-exchange puts go to (those of this host, if any)."""
        return max(1, len(self._near_units()) or len(self.unit_addresses))

    async def _put_batch(self, key: Hashable, puts: list[coalesce.Pending]) -> None:
        """One put for ``puts``; refused, each is made on its own (its own answer)."""
        with self._flights.flying(key, (p.caller for p in puts)):
            await self._put_merged(puts)

    async def _put_merged(self, puts: list[coalesce.Pending]) -> None:
        async def alone(p: coalesce.Pending) -> BatchMeta:
            return await self._put_one(*encoded(p.req, p.columns))

        try:
            if len(puts) == 1:
                result: Any = [await alone(puts[0])]
            else:
                merged = await self._put_one(*coalesce.merge(puts))
                result = coalesce.split(merged, puts)
        except (UnitLostError, ConnectionLostError, ClosedError, RequestTimeoutError) as exc:
            result = exc  # what happened to the merged put happened to each of them
        except TQStreamError as exc:
            if len(puts) == 1:
                result = exc
            else:  # refused as a whole, nothing kept: each on its own
                outcomes = await asyncio.gather(*map(alone, puts), return_exceptions=True)
                result = list(outcomes)
        except BaseException as exc:
            result = exc
            if not isinstance(exc, Exception):  # cancelled: the client is closing
                for p in puts:
                    if not p.answer.done():
                        p.answer.set_exception(ClosedError(CLOSED_DURING))
                raise
        for i, p in enumerate(puts):
            outcome = result if isinstance(result, BaseException) else result[i]
            if p.answer.done():  # its caller was cancelled
                continue
            if isinstance(outcome, BaseException):
                p.answer.set_exception(outcome)
            else:
                p.answer.set_result(outcome)

    async def _put_placed(self, req: PreparePut, columns: dict[str, Column]) -> BatchMeta:
        """A put the controller places first (prepare), then stored on its units and committed."""
        partition = req.partition
        wait = None if req.timeout is None else req.timeout + GET_GRACE
        if self.near and len(self.near) < len(self.unit_addresses):
            req = msgspec.structs.replace(req, near=sorted(self.near))
        plan: PutPlan = await self._ask(req, PutPlan, timeout=wait)

        async def store() -> BatchMeta:
            jobs = []
            for seg in plan.segments:
                part = {k: c.slice(seg.start, seg.stop) for k, c in columns.items()}
                rows = plan.rows()[seg.start : seg.stop]
                for unit in (seg.unit, seg.replica):
                    if unit >= 0:
                        jobs.append(
                            self._store(partition, unit, seg.chunk, rows, part, plan.generation)
                        )
            await _all(jobs)
            reply = await self._ask(CommitPut(rid=0, put_id=plan.put_id), MetaReply)
            meta = reply.batch()
            if req.rejected:
                meta = msgspec.structs.replace(meta, rejected=req.rejected)
            return meta

        return await self._committed(plan.put_id, store())

    async def _put_direct(
        self,
        req: PreparePut,
        columns: dict[str, Column],
        wait: float | None,
        unit: int | None = None,
    ) -> BatchMeta:
        """One exchange: the next reachable storage unit in turn takes the rows and commits them.
        The bytes go through the unit's shared memory when it shares this host and the put has
        ``shared_memory_min_bytes``, else as one packed frame."""
        unit = self._direct_unit() if unit is None else unit
        wait = None if wait is None else wait + GET_GRACE  # the unit waits for the controller
        segment, kept = "", 0
        try:
            conn = await self._unit(unit)
            msg: PutRows | None = None
            buffers: list[Any] = []
            token = self._token(unit)
            if token and req.nbytes >= self.config.shared_memory_min_bytes:
                refs, buffers = columns_to_wire(columns, parts=True)  # rows copied into place
                segment = shm.direct_segment(token)
                written = self._write_shared(unit, segment, buffers)
                if written is not None:
                    kept = written[2]
                    msg, buffers = PutRows(rid=0, put=req, columns=refs, shared=written[0],
                                           reused=written[1], local=True), []  # fmt: skip
            if msg is None:
                segment = ""
                refs, buffers = columns_to_wire(columns, packed=True)
                msg = PutRows(rid=0, put=req, columns=refs, local=unit in self.hosted)
            reply: MetaReply = await self._ask(
                msg, MetaReply, conn=conn, buffers=buffers, timeout=wait
            )
            segment = ""  # the unit took it
        except (ConnectError, ConnectionLostError) as exc:
            self._skip[unit] = time.monotonic() + self.config.connect_timeout
            raise UnitLostError(
                f"storage unit {unit} at {self.unit_addresses[unit]} did not take a put of "
                f"{req.n_rows} rows to partition {req.partition!r}: {exc.message}; if it had "
                f"stored them before it went away they are lost with it (counted as lost in "
                f"stats); retry the put — this client avoids the unit for "
                f"{self.config.connect_timeout}s",
                unit=unit,
                address=self.unit_addresses[unit],
            ) from exc
        finally:
            if segment:  # not taken yet: the unit finds nothing and refuses (shm.py), or took it
                shm.unlink(segment)
                self._writer.forget(kept)
        if msg.shared:
            self._spares[unit] = list(reply.spare)
        meta = reply.batch()
        return msgspec.structs.replace(meta, rejected=req.rejected) if req.rejected else meta

    def _write_shared(
        self, unit: int, name: str, buffers: Sequence[Any]
    ) -> tuple[list[Region], str, int] | None:
        """Write ``buffers`` to segment ``name`` of ``unit``'s shared memory (into one of its spares
        when one fits): the regions, the claimed spare's name and the kept mapping's inode
        (``shm.Writer.write``), or None when /dev/shm has no room (frames still work)."""
        try:
            return self._writer.write(name, buffers, self._spares.setdefault(unit, []))
        except OSError:
            return None

    def _receiver(self, unit: int, token: str) -> shm.Receiver:
        """``unit``'s receive segments; a unit restarted under a new token gets new ones (the old
        unit's are let go: their names were swept with it)."""
        receiver = self._receivers.get(unit)
        if receiver is None or receiver.token != token:
            if receiver is not None:
                receiver.close()
            receiver = self._receivers[unit] = shm.Receiver(token)
        return receiver

    def _direct_unit(self) -> int:
        """The unit a one-exchange put goes to: the next reachable one in turn, of those on this
        host if one of them is reachable, else of all."""
        n, now = len(self.unit_addresses), time.monotonic()
        near = self._near_units()
        unit = self._turn % n
        for pool in (near, list(range(n))) if near else (list(range(n)),):
            for _ in range(len(pool)):
                unit = pool[self._turn % len(pool)]
                self._turn += 1
                if self._skip.get(unit, 0.0) <= now and not self._is_down(unit):
                    return unit
        return unit

    def _near_units(self) -> list[int]:
        """The units of this host that one-exchange puts prefer (none without locality)."""
        n = len(self.unit_addresses)
        return [u for u in sorted(self.near) if u < n]

    async def write_fields(
        self, req: PrepareFields, columns: dict[str, Column]
    ) -> BatchMeta | None:
        """A put_fields (rows named by id or, creating the missing ones, by key): plan, store on
        each row's unit and its replica, commit; the rows' metadata when named by key."""
        plan: FieldsPlan = await self._ask(req, FieldsPlan)
        row_ids = plan.row_ids or req.row_ids

        async def store() -> BatchMeta | None:
            jobs = []
            for seg, pos in zip(plan.segments, plan.positions, strict=True):
                if pos == list(range(pos[0], pos[0] + len(pos))):
                    part = {k: c.slice(pos[0], pos[0] + len(pos)) for k, c in columns.items()}
                else:
                    index = torch.tensor(pos, dtype=torch.int64)
                    part = {k: c.take(index) for k, c in columns.items()}
                rows = [row_ids[i] for i in pos]
                for unit in (seg.unit, seg.replica):
                    if unit >= 0:
                        jobs.append(
                            self._store(req.partition, unit, seg.chunk, rows, part,
                                        plan.generation, req.overwrite)
                        )  # fmt: skip
            await _all(jobs)
            reply = await self._ask(CommitPut(rid=0, put_id=plan.put_id), (Ok, MetaReply))
            return reply.batch() if isinstance(reply, MetaReply) else None

        return await self._committed(plan.put_id, store())

    def _is_down(self, unit: int) -> bool:
        task = self._units.get(unit)
        if task is None or not task.done() or task.cancelled():
            return False
        return task.exception() is not None or task.result().down

    async def _store(
        self,
        partition: str,
        unit: int,
        chunk: int,
        rows: Sequence[int],
        part: dict[str, Column],
        generation: int,
        overwrite: bool = False,
    ) -> None:
        """Store one chunk of rows of ``generation`` (the plan's) on ``unit``; a shared-memory
        store learns the unit's spares."""
        conn = await self._unit(unit)
        token = self._token(unit)
        refs, buffers = columns_to_wire(part, parts=bool(token))  # rows copied into place
        run = isinstance(rows, range) and len(rows) > 0
        msg = Store(rid=0, partition=partition, chunk=chunk, columns=refs, overwrite=overwrite,
                    local=unit in self.hosted, row_ids=[] if run else list(rows),
                    first_row=rows[0] if run else 0, n_rows=len(rows) if run else 0,
                    generation=generation)  # fmt: skip
        size = sum(nbytes(b) for b in buffers)
        kept = 0
        if token and buffers and size >= self.config.shared_memory_min_bytes:
            written = self._write_shared(unit, shm.chunk_segment(token, chunk), buffers)
            if written is not None:
                msg = msgspec.structs.replace(msg, shared=written[0], reused=written[1])
                buffers, kept = [], written[2]
        buffers = joined(buffers)  # frames: a column's rows joined into one (a copy each)
        try:
            reply: Ok = await self._ask(msg, Ok, conn=conn, buffers=buffers)
        except BaseException:
            self._writer.forget(kept)  # the unit may have mapped it, or map it still
            raise
        if msg.shared:
            self._spares[unit] = list(reply.spare)

    async def _committed(self, put_id: int, work: Any) -> Any:
        """Run the store+commit phase; on any failure roll the put back before re-raising."""
        try:
            return await work
        except BaseException:
            abort = asyncio.ensure_future(
                self._ask(AbortPut(rid=0, put_id=put_id), Ok, timeout=self.config.connect_timeout)
            )
            # if the abort fails too, the controller's put_timeout rolls the put back instead
            with contextlib.suppress(TQStreamError, asyncio.CancelledError):
                await asyncio.shield(abort)
            raise

    # --- reads ---
    async def get_meta(self, req: GetMeta) -> BatchMeta:
        timeout = None if req.timeout is None else req.timeout + GET_GRACE
        reply = await self._ask(req, MetaReply, timeout=timeout)
        return reply.batch()

    async def get(self, req: GetMeta) -> tuple[BatchMeta, dict[str, Column]]:
        """``get_meta`` and ``fetch`` in one go; if the fetch fails the lease is released (best
        effort: otherwise it expires and the rows come back anyway)."""
        meta = await self.get_meta(req)
        try:
            return meta, await self.fetch(meta, list(meta.fields))
        except BaseException:
            self.release_soon(meta)
            raise

    def release_soon(self, meta: BatchMeta) -> None:
        """Release ``meta``'s lease in the background, ignoring failures (call on the loop)."""
        if self.release_elsewhere is not None:
            self.release_elsewhere(meta)
            return

        async def release() -> None:
            with contextlib.suppress(TQStreamError):
                await self.ack(meta, release=True)

        task = asyncio.get_running_loop().create_task(release(), name="tqstream-release")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def fetch(self, meta: BatchMeta, fields: list[str]) -> dict[str, Column]:
        """The rows' columns, in batch order; rows held by several units are fetched in parallel."""
        if not meta.row_ids or not fields:
            return {}
        if meta.replicas and self.near:
            meta = read_near(meta, self.near)
        by_unit = _by_unit(meta.units, range(len(meta.row_ids)))
        jobs = [self._fetch_from(meta, u, pos, fields) for u, pos in by_unit.items()]
        pieces = [piece for pieces in await _all(jobs) for piece in pieces]
        if len(pieces) == 1:  # one piece holds every row, in batch order
            return pieces[0][1]
        order = [i for pos, _ in pieces for i in pos]
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order))
        return {f: Column.concat([p[f] for _, p in pieces]).take(inverse) for f in fields}

    async def _fetch_from(
        self, meta: BatchMeta, unit: int, positions: list[int], fields: list[str]
    ) -> list[tuple[list[int], dict[str, Column]]]:
        """The columns of the rows at ``positions`` of ``meta``, held by ``unit`` — or, if the
        unit is gone, by their replicas: ``(positions, columns)`` pieces."""
        try:
            if self._is_down(unit) and meta.replicas:
                raise ConnectionLostError(f"the connection to storage unit {unit} is down")
            conn = await self._unit(unit)
            token = self._token(unit)
            receiver = self._receiver(unit, token) if token else None
            offered = receiver.offer() if receiver is not None else []
            msg = Fetch(
                rid=0,
                partition=meta.partition,
                row_ids=[meta.row_ids[i] for i in positions],
                fields=fields,
                shared=bool(token),
                local=unit in self.hosted,
                into=offered,
                generation=meta.generation,
            )
            try:
                reply, frames = await self._ask(msg, Columns, conn=conn)
            except BaseException:
                if receiver is not None:
                    receiver.failed(offered)  # the unit may write them still
                raise
        except (ConnectError, ConnectionLostError) as exc:
            replicas = [meta.replicas[i] for i in positions] if meta.replicas else []
            if replicas and all(r >= 0 and r != unit for r in replicas):
                copies = _by_unit(replicas, positions)
                nested = await _all(
                    [self._fetch_from(_primary(meta), r, pos, fields) for r, pos in copies.items()]
                )
                return [piece for pieces in nested for piece in pieces]
            address = self.unit_addresses[unit] if unit < len(self.unit_addresses) else "?"
            keys = [meta.keys[i] for i in positions]
            shown = ", ".join(repr(k) for k in keys[:3]) + (" ..." if len(keys) > 3 else "")
            raise UnitLostError(
                f"storage unit {unit} at {address} is unreachable ({exc.message}): {len(keys)} "
                f"rows of partition {meta.partition!r} it holds (keys {shown}) cannot be read and "
                f"have no replica; the controller counts them as lost once it has declared the "
                f"unit lost (within 3 heartbeats). Get again: this batch's lease is released and "
                f"the rows on other units are served again; keep two copies "
                f"(replicas=2) to ride out a unit's loss",
                unit=unit,
                address=address,
                partition=meta.partition,
                rows=len(keys),
            ) from exc
        if receiver is not None:
            try:
                if reply.shared:
                    frames = _shared_frames(token, reply.shared, frames)
            finally:  # mapped (or not there): a fresh gather segment becomes the receiver's
                receiver.done(offered, list(reply.shared.values()))
        return [(positions, {ref.name: column_from_wire(ref, frames) for ref in reply.columns})]

    async def get_by_keys(
        self,
        partition: str,
        keys: list[str],
        fields: list[str] | None,
        row_ids: list[int] | None = None,
        missing_ok: bool = False,
    ) -> BatchMeta:
        msg = GetByKeys(
            rid=0,
            partition=partition,
            keys=keys,
            fields=fields,
            row_ids=row_ids or [],
            missing_ok=missing_ok,
        )
        return (await self._ask(msg, MetaReply)).batch()

    async def list_keys(self, partition: str) -> list[str]:
        return (await self._ask(ListKeys(rid=0, partition=partition), KeysReply)).keys

    # --- consumption and lifecycle ---
    async def ack(
        self, meta: BatchMeta, release: bool = False, coalesce: bool = True, resumed: bool = False
    ) -> int:
        """Ack (or release) ``meta``'s rows; with ``coalesce`` (and ``coalesce_window`` not None)
        in one message with the acks and releases issued with it, each answered alone."""
        if meta.lease_id is None or meta.task is None:
            raise InvalidRequestError(
                "this BatchMeta holds no lease (it came from put or get_by_keys); only batches "
                "from get_meta/get can be acked or released"
            )
        p, t, lease, rows = meta.partition, meta.task, meta.lease_id, meta.row_ids
        if release:
            msg: Any = Release(rid=0, partition=p, task=t, lease_id=lease, row_ids=rows)
        else:
            msg = Ack(rid=0, partition=p, task=t, lease_id=lease, row_ids=rows,
                      tokens_masked=meta.tokens_masked, resumed=resumed)  # fmt: skip
        if coalesce and self.config.coalesce_window is not None:
            return await self._consume_coalesced(msg)
        return (await self._ask(msg, Ok)).count

    async def _consume_coalesced(self, msg: Ack | Release) -> int:
        """Send the ack with the others issued with it (one ``Consume``); its own count back."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[int] = loop.create_future()
        if self._consuming is not None:  # the first one sends them
            self._consuming.append((msg, answer))
            return await answer
        self._consuming = [(msg, answer)]
        try:
            await asyncio.sleep(self.config.coalesce_window or 0.0)
        except BaseException:
            answer.cancel()  # not sent: this ack is not made
            raise
        finally:
            items = [(m, a) for m, a in self._consuming if not a.done()]
            self._consuming = None
            if len(items) > 1 or (items and items[0][1] is not answer):
                task = loop.create_task(self._send_consume(items))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        if len(items) == 1:
            return (await self._ask(msg, Ok)).count
        return await answer

    async def _send_consume(self, items: list[tuple[Ack | Release, asyncio.Future[int]]]) -> None:
        try:
            reply = await self._ask(Consume(rid=0, items=[m for m, _ in items]), Results)
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else ClosedError(CLOSED_DURING)
            for _, answer in items:
                if not answer.done():
                    answer.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, answer), result in zip(items, reply.results, strict=True):
            if answer.done():  # its caller was cancelled
                continue
            if isinstance(result, ErrorReply):
                answer.set_exception(error_from_reply(result))
            else:
                answer.set_result(result.count)

    async def clear_samples(self, meta: BatchMeta) -> None:
        await self._ask(ClearSamples(rid=0, partition=meta.partition, row_ids=meta.row_ids), Ok)

    async def clear_partition(self, partition: str) -> bool:
        return bool((await self._ask(ClearPartition(rid=0, partition=partition), Ok)).count)

    async def call(self, msg: Any, expect: type = Ok, timeout: float | None = -1.0) -> Any:
        """A plain request to the controller (no data frames)."""
        return await self._ask(msg, expect, timeout=timeout)

    async def stats(self, partition: str | None) -> Stats:
        return (await self._ask(GetStats(rid=0, partition=partition), StatsReply)).stats
