"""Records the controller state keeps and returns: effects for the service, pending puts,
leases, parked requests, and the version arithmetic of staleness windows. Pure data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, NamedTuple, TypeVar, get_args

import msgspec
import numpy as np

from tqstream.controller.admission import Admission
from tqstream.controller.peers import peer_of
from tqstream.controller.rows import Row
from tqstream.errors import AdmissionError, InvalidRequestError, TQStreamError
from tqstream.protocol.messages import Acquire, GetMeta, PreparePut
from tqstream.types import BatchMeta, Measure


def version_of(r: Row, measure: Measure) -> int | None:
    """The version a staleness window compares: head = the oldest generated token's (AReaL's
    bound), tail = the newest's, dispatch = the policy version when generation was requested;
    token = the newest's too (a row is read while any token is inside; the client masks the
    tokens outside, see ``client/versions.fresh_mask``)."""
    if measure in ("tail", "token"):
        return r.version_end
    if measure == "dispatch" and r.dispatch_version is not None:
        return r.dispatch_version
    return r.version_start


def check_window(req: GetMeta) -> None:
    """The window checks left to the controller: a negative bound from a peer that skipped the
    client's (``StalenessPolicy`` checks them all; a ``measure`` or ``on_stale`` outside its set
    is refused at decoding), and a bound without a version to place it."""
    if req.max_staleness is not None:
        if req.max_staleness < 0:
            raise InvalidRequestError(f"max_staleness must be >= 0, got {req.max_staleness}")
        if req.current_version is None:
            raise InvalidRequestError(
                "max_staleness needs current_version (the trainer's policy version) to place the "
                "window: pass current_version=v"
            )


DeadlineKind = Literal["lease", "park", "acquire", "putwait", "put", "ttl", "pair"]
"""What an entry of the state's deadline heap ends: a lease, a parked get, an acquire or a put
waiting for room, an uncommitted put, the ttl of a partition's rows, one copy of a replicated
one-exchange put waiting for the other."""
LeaseEnd = Literal["acked", "released", "expired", "disconnected", "reset", "cleared"]
"""How a lease ended (kept a while, to answer an ack that comes after it)."""
PutEnd = Literal["committed", "aborted", "expired", "cleared", "unit-lost"]
"""How a put ended (kept a while, to answer a commit or abort that comes after it)."""
Ended = TypeVar("Ended", LeaseEnd, PutEnd)

FINISHED_LIMIT = 100_000
"""Ended puts (and leases) remembered, the newest ones."""
COMPACT_MIN = 1024
"""The deadline heap is swept of ended entries once it holds this many, then at twice its live
size after each sweep."""


class Finished(Generic[Ended]):
    """How the newest ``limit`` puts (or leases) ended, by id: what answers a commit, an abort or
    an ack that comes after its put or lease ended.

    Ids and status codes sit in two numpy arrays used as a ring (9 bytes an id, where a dict of
    ints to strings took ~200), grown by doubling up to ``limit``; once full, each new id
    replaces the oldest. The newest id is found at once (a commit asks right after ending its
    put); any other by one vectorised scan, which only late or repeated calls make.
    """

    def __init__(self, statuses: Sequence[Ended], limit: int = FINISHED_LIMIT) -> None:
        if not 0 < len(statuses) <= 256 or limit < 1:
            raise ValueError("Finished needs 1 to 256 statuses and a limit of at least 1")
        self._names: tuple[Ended, ...] = tuple(statuses)
        self._codes: dict[str, int] = {s: code for code, s in enumerate(self._names)}
        self._limit = limit
        self._ids = np.zeros(min(limit, 1024), dtype=np.int64)
        self._status = np.zeros(len(self._ids), dtype=np.uint8)
        self._count = 0  # ids held (at most limit)
        self._next = 0  # where the next id goes

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes the records take (their arrays, grown ahead of use)."""
        return int(self._ids.nbytes + self._status.nbytes)

    def end(self, key: int, status: Ended) -> None:
        """Record that ``key`` ended with ``status``; the oldest record goes once ``limit`` are
        held."""
        code = self._codes[status]
        if self._next == len(self._ids) and len(self._ids) < self._limit:
            size = min(2 * len(self._ids), self._limit)
            self._ids = np.resize(self._ids, size)
            self._status = np.resize(self._status, size)
        self._ids[self._next] = key
        self._status[self._next] = code
        self._next = (self._next + 1) % self._limit
        self._count = min(self._count + 1, self._limit)

    def get(self, key: int) -> Ended | None:
        """How ``key`` ended, None when it is not (or no longer) recorded."""
        if not self._count:
            return None
        newest = (self._next - 1) % self._limit
        if self._ids[newest] == key:
            return self._names[self._status[newest]]
        found = np.flatnonzero(self._ids[: self._count] == key)
        if not len(found):
            return None
        # a repeated id answers with its newest end: the one written last, in ring order
        newest = found[np.argmax((found - self._next) % self._limit)]
        return self._names[self._status[newest]]


class Ids:
    """The one increasing sequence of the controller's put, lease, chunk and partition-incarnation
    ids (an id's order says which came first: a lease older than its partition's incarnation
    belongs to an earlier one)."""

    def __init__(self, first: int = 1) -> None:
        self._next = first

    def __iter__(self) -> Ids:
        return self

    def __next__(self) -> int:
        n = self._next
        self._next += 1
        return n

    def skip_to(self, first: int) -> None:
        """Never hand out an id below ``first`` (a checkpoint's ids are taken)."""
        self._next = max(self._next, first)


@dataclasses.dataclass
class Effects:
    """What the service must do after a state change."""

    served: list[tuple[Any, BatchMeta]] = dataclasses.field(default_factory=list)
    failed: list[tuple[Any, TQStreamError]] = dataclasses.field(default_factory=list)
    drop_rows: dict[int, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    drop_chunks: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # (partition, first chunk id after the clear): on every unit, drop the older chunks only
    drop_partitions: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    replies: list[tuple[Any, msgspec.Struct]] = dataclasses.field(default_factory=list)
    # (unit, first chunk id after its revival): the unit drops every older chunk it holds
    reset_units: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # unit -> chunks of committed overwrites: their staged values replace the old ones
    publish: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # Signals between the parts of the state, settled before the effects leave it
    # (ControllerState.settle): partitions whose parked gets may be served now, whether bytes or
    # rows were freed (puts waiting for room try again), admissions whose parked acquires may be
    # granted now.
    touched: set[str] = dataclasses.field(default_factory=set)
    room: bool = False
    woken: set[str] = dataclasses.field(default_factory=set)

    def extend(self, other: Effects) -> None:
        self.served += other.served
        self.failed += other.failed
        for unit, parts in other.drop_rows.items():
            mine = self.drop_rows.setdefault(unit, {})
            for partition, rows in parts.items():
                mine.setdefault(partition, []).extend(rows)
        for unit, chunks in other.drop_chunks.items():
            self.drop_chunks.setdefault(unit, []).extend(chunks)
        self.drop_partitions += other.drop_partitions
        self.replies += other.replies
        self.reset_units += other.reset_units
        for unit, chunks in other.publish.items():
            self.publish.setdefault(unit, []).extend(chunks)
        self.touched |= other.touched
        self.room = self.room or other.room
        self.woken |= other.woken

    def __bool__(self) -> bool:
        return bool(
            self.served
            or self.failed
            or self.drop_rows
            or self.drop_chunks
            or self.drop_partitions
            or self.replies
            or self.reset_units
            or self.publish
        )


@dataclasses.dataclass
class PendingPut:
    put_id: int
    partition: str
    ids: Sequence[int]  # its rows (a range for a put's new rows)
    mask: int
    fields: list[str]
    chunks: list[tuple[int, int]]  # (unit, chunk)
    new_rows: bool  # a put (True) or a put_fields (False)
    per_row: int  # bytes per row, for the units' load estimate
    cancelled: bool = False  # its partition was cleared: only its chunks remain to drop
    rejected: int = 0  # rows the producer refused; counted when the put commits, like produced
    owner: Any = None  # the producer's peer: its put is aborted when it disconnects
    # a put_fields by key: the rows it creates (committed with its fields, or removed with it)
    created: set[int] = dataclasses.field(default_factory=set)
    tags: list[Any] | None = None  # per row of ``ids``, tags merged in at the commit
    shapes: dict[str, Any] | None = None  # the TransferQueue layer's record (RowShapes by field)
    keyed: bool = False  # a put_fields by key: its commit answers with the rows' metadata
    versions: tuple[list[int | None], list[int | None]] | None = None  # (starts, ends) per row
    overwrite: bool = False  # its chunks are published to the units at the commit
    units: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # put_fields: per row


class WaitingPut(NamedTuple):
    """A put waiting for room under a quota: its request, since when it waits, and the unit it
    was stored on first (a direct put; None for a placed one)."""

    req: PreparePut
    since: float
    pinned: int | None


class Half(NamedTuple):
    """One copy of a replicated one-exchange put (``PreparePut.pair``), held by ``unit``, waiting
    for the other; ``handle`` answers it."""

    req: PreparePut
    unit: int
    handle: Any


Record = TypeVar("Record")


class Ledger(Mapping[int, Record], Generic[Record, Ended]):
    """Records in flight by id (a read-only mapping) and how the newest ended ones ended. A record
    starts only by :meth:`_start` and ends only by :meth:`_finish`, so that an ended one is always
    recorded and never still in flight, and an id is never used twice."""

    def __init__(self, statuses: Sequence[Ended]) -> None:
        self._active: dict[int, Record] = {}
        self._ended: Finished[Ended] = Finished(statuses)
        self._high = -1  # the highest id started: a higher one has not ended (no scan of _ended)

    def __getitem__(self, key: int) -> Record:
        return self._active[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._active)

    def __len__(self) -> int:
        return len(self._active)

    def _start(self, key: int, record: Record) -> None:
        if key in self._active or (key <= self._high and self._ended.get(key) is not None):
            raise ValueError(f"id {key} was used before")
        self._active[key] = record
        self._high = max(self._high, key)

    def _finish(self, key: int, status: Ended) -> Record | None:
        """``key`` ends with ``status``: its record, or None when it was not in flight (ending it
        again is a no-op)."""
        record = self._active.pop(key, None)
        if record is not None:
            self._ended.end(key, status)
        return record


class PutBook(Ledger[PendingPut, PutEnd]):
    """The puts in flight (prepared, neither committed nor rolled back: a read-only mapping of
    id to :class:`PendingPut`), how the newest ended ones ended, and the puts waiting for room
    under a quota. A put starts only by :meth:`open` and ends only by :meth:`end`."""

    def __init__(self) -> None:
        super().__init__(get_args(PutEnd))
        self._waiting: dict[Any, WaitingPut] = {}  # by request handle, in arrival order
        self._halves: dict[int, Half] = {}  # by pair token

    def open(self, put: PendingPut) -> None:
        self._start(put.put_id, put)

    def end(self, put_id: int, status: PutEnd) -> PendingPut | None:
        """The put ends (``status`` answers a late commit or abort): the put, or None when it was
        not in flight (ending it again is a no-op)."""
        return self._finish(put_id, status)

    def status(self, put_id: int) -> Literal["pending"] | PutEnd | None:
        """``"pending"``, how the put ended, or None (never opened, or ended too long ago)."""
        return "pending" if put_id in self._active else self._ended.get(put_id)

    def where(
        self, *, partition: str | None = None, owner: Any = None, unit: int | None = None,
        live: bool = False,
    ) -> list[PendingPut]:  # fmt: skip
        """The puts in flight of a partition, an owner, with a chunk on a unit and/or (``live``)
        whose partition was not cleared since (a copy: safe to end them while going through it)."""
        return [
            put
            for put in self._active.values()
            if (partition is None or put.partition == partition)
            and (owner is None or put.owner == owner)
            and (unit is None or any(u == unit for u, _ in put.chunks))
            and not (live and put.cancelled)
        ]

    def fields_in_flight(self, partition: str) -> set[str]:
        """The fields the live puts in flight to ``partition`` write."""
        return {f for put in self.where(partition=partition, live=True) for f in put.fields}

    # --- waiting for room ---
    def park(self, handle: Any, waiting: WaitingPut) -> None:
        self._waiting[handle] = waiting

    def unpark(self, handle: Any) -> WaitingPut | None:
        """Stop the wait of ``handle``'s put: how it waited, None when it does not wait."""
        return self._waiting.pop(handle, None)

    def parked(self, handle: Any) -> WaitingPut | None:
        return self._waiting.get(handle)

    def waiting(self) -> list[tuple[Any, WaitingPut]]:
        """The waiting puts by handle, in arrival order (a copy)."""
        return list(self._waiting.items())

    # --- one copy of a replicated put, waiting for the other ---
    def hold_half(self, token: int, half: Half) -> None:
        self._halves[token] = half

    def take_half(self, token: int) -> Half | None:
        return self._halves.pop(token, None)

    def holds_half(self, token: int) -> bool:
        return token in self._halves

    def halves_with(self, unit: int) -> list[tuple[int, Half]]:
        """The waiting copies held by ``unit`` or waiting for a copy from it (a copy)."""
        return [
            (token, half)
            for token, half in self._halves.items()
            if unit in (half.req.pair.units if half.req.pair is not None else (half.unit,))
        ]


@dataclasses.dataclass
class Lease:
    lease_id: int
    partition: str
    task: str
    rows: set[int]
    deadline: float
    current_version: int | None = None  # the reader's version, for the lag at consumption
    measure: Measure = "head"
    owner: Any = None  # the reader's peer: its rows go back to available when it disconnects
    acked: set[int] | None = None  # rows acked under it while others stay leased (a partial ack)


PARTLY_ACKED_LIMIT = 10_000
"""Leases that expired after a partial ack whose acked rows are remembered, the newest ones."""


class LeaseTable(Ledger[Lease, LeaseEnd]):
    """The leases granted and not ended (a read-only mapping of id to :class:`Lease`), and how
    the newest ended ones ended: a lease starts only by :meth:`grant` and ends only by
    :meth:`end`."""

    def __init__(self) -> None:
        super().__init__(get_args(LeaseEnd))
        # lease id -> the rows acked under it before it expired or was given up: a repeat of
        # that ack is harmless, any other call on the lease raises (its batch went elsewhere)
        self._partly_acked: dict[int, frozenset[int]] = {}

    def grant(self, lease: Lease) -> None:
        self._start(lease.lease_id, lease)

    def end(self, lease: Lease, status: LeaseEnd) -> None:
        """The lease ends (``status`` answers a late ack or release); ending it again is a
        no-op."""
        ended = self._finish(lease.lease_id, status)
        if ended is not None and ended.acked and status in ("expired", "disconnected"):
            self.acked_after_end(lease.lease_id, ended.acked)

    def acked_after_end(self, lease_id: int, rows: Iterable[int]) -> None:
        """``rows`` count as acked under the ended lease ``lease_id`` (a repeat is harmless)."""
        if lease_id not in self._partly_acked and len(self._partly_acked) >= PARTLY_ACKED_LIMIT:
            del self._partly_acked[next(iter(self._partly_acked))]
        self._partly_acked[lease_id] = self._partly_acked.get(lease_id, frozenset()) | set(rows)

    def acked_before_end(self, lease_id: int) -> frozenset[int]:
        """The rows acked under an expired or given-up lease before it ended (empty: none, or
        forgotten)."""
        return self._partly_acked.get(lease_id, frozenset())

    def status(self, lease_id: int) -> Literal["active"] | LeaseEnd | None:
        """``"active"``, how the lease ended, or None (never granted, or ended too long ago)."""
        return "active" if lease_id in self._active else self._ended.get(lease_id)

    def where(
        self, *, partition: str | None = None, task: str | None = None, owner: Any = None
    ) -> list[Lease]:
        """The active leases of a partition, a task and/or an owner (a copy: safe to end them
        while going through it)."""
        return [
            lease
            for lease in self._active.values()
            if (partition is None or lease.partition == partition)
            and (task is None or lease.task == task)
            and (owner is None or lease.owner == owner)
        ]

    def forget_rows(self, partition: str, row_ids: set[int]) -> None:
        """Rows of ``partition`` were deleted: they leave their leases, and a lease left without
        rows ends ``"cleared"``."""
        for lease in self.where(partition=partition):
            if lease.rows & row_ids:
                lease.rows -= row_ids
                if not lease.rows:
                    self.end(lease, "cleared")


@dataclasses.dataclass(eq=False)
class Parked:
    handle: Any
    req: GetMeta
    mask: int
    dropped: int = 0  # rows evicted as stale by its tries so far (reported when served)


class ParkedGets:
    """The gets waiting for rows, by partition, in arrival order. A get is parked once and leaves
    once: served, failed, timed out, cancelled, or with its partition or its peer. Indexed by
    handle and by peer too: a cancel or a peer's departure costs what it takes out, not what is
    parked (thousands of clients may each have a get parked)."""

    def __init__(self) -> None:
        self._by_partition: dict[str, dict[Any, Parked]] = {}
        self._by_handle: dict[Any, Parked] = {}
        self._by_peer: dict[Any, set[Any]] = {}  # peer -> the handles of its parked gets

    def __len__(self) -> int:
        return len(self._by_handle)

    def park(self, parked: Parked) -> None:
        if parked.handle in self._by_handle:
            raise ValueError("a request handle parks one get at a time")
        self._by_partition.setdefault(parked.req.partition, {})[parked.handle] = parked
        self._by_handle[parked.handle] = parked
        peer = peer_of(parked.handle)
        if peer is not None:
            self._by_peer.setdefault(peer, set()).add(parked.handle)

    def of(self, partition: str) -> list[Parked]:
        """The gets parked on ``partition``, in arrival order (a copy)."""
        return list(self._by_partition.get(partition, {}).values())

    def count(self, partition: str) -> int:
        return len(self._by_partition.get(partition, {}))

    def holds(self, parked: Parked) -> bool:
        return self._by_handle.get(parked.handle) is parked

    def unpark(self, parked: Parked) -> bool:
        """Take ``parked`` out; False when it had left already."""
        if not self.holds(parked):
            return False
        self._forget(parked)
        return True

    def drop_partition(self, partition: str) -> list[Parked]:
        """Take out and return every get parked on ``partition``."""
        out = list(self._by_partition.get(partition, {}).values())
        for parked in out:
            self._forget(parked)
        return out

    def cancel(self, handle: Any) -> None:
        """The requester went away: forget its parked get."""
        parked = self._by_handle.get(handle)
        if parked is not None:
            self._forget(parked)

    def drop_peer(self, peer: Any) -> None:
        """Forget every get parked by ``peer``'s connections."""
        for handle in list(self._by_peer.get(peer, ())):
            self._forget(self._by_handle[handle])

    def _forget(self, parked: Parked) -> None:
        del self._by_handle[parked.handle]
        waiting = self._by_partition[parked.req.partition]
        del waiting[parked.handle]
        if not waiting:
            del self._by_partition[parked.req.partition]
        peer = peer_of(parked.handle)
        if peer is not None:
            handles = self._by_peer[peer]
            handles.discard(parked.handle)
            if not handles:
                del self._by_peer[peer]


class AdmissionRecord(NamedTuple):
    """A producer admission: its policy object and the settings it was created with (creating it
    again must give the same ones)."""

    admission: Admission
    style: str
    config: dict[str, int]


class WaitingAcquire(NamedTuple):
    req: Acquire
    since: float


class AdmissionTable(Mapping[str, AdmissionRecord]):
    """The producer admissions by name (a read-only mapping to :class:`AdmissionRecord`), the
    acquires waiting for a slot, and which peer holds each granted slot (its slots go back when it
    disconnects)."""

    def __init__(self) -> None:
        self._records: dict[str, AdmissionRecord] = {}
        self._waiting: dict[Any, WaitingAcquire] = {}  # by request handle, in arrival order
        self._owners: dict[str, dict[int, Any]] = {}  # admission -> slot id -> peer

    def __getitem__(self, name: str) -> AdmissionRecord:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def install(self, name: str, record: AdmissionRecord) -> None:
        """Add admission ``name`` (or replace it: a checkpoint's, loaded)."""
        self._records[name] = record

    def admission(self, name: str) -> Admission:
        """Admission ``name``'s policy; ``AdmissionError`` when there is none."""
        record = self._records.get(name)
        if record is None:
            raise AdmissionError(
                f"admission {name!r} does not exist; create it first with "
                f"client.admission(style, name={name!r}, ...)",
                name=name,
            )
        return record.admission

    def states(self) -> dict[str, dict[str, int | float | str]]:
        return {name: record.admission.state() for name, record in self._records.items()}

    # --- acquires waiting for a slot ---
    def park(self, handle: Any, waiting: WaitingAcquire) -> None:
        self._waiting[handle] = waiting

    def unpark(self, handle: Any) -> WaitingAcquire | None:
        """Stop the wait of ``handle``'s acquire: how it waited, None when it does not wait."""
        return self._waiting.pop(handle, None)

    def parked(self, handle: Any) -> WaitingAcquire | None:
        return self._waiting.get(handle)

    def waiting(self, name: str | None = None) -> list[tuple[Any, WaitingAcquire]]:
        """The waiting acquires (of admission ``name``) by handle, in arrival order (a copy)."""
        return [(h, w) for h, w in self._waiting.items() if name is None or w.req.name == name]

    # --- who holds the granted slots ---
    def own(self, name: str, slot_ids: Sequence[int], peer: Any) -> None:
        """``peer`` holds these slots of ``name`` (None: nobody to watch, e.g. in-process)."""
        if peer is not None and slot_ids:
            self._owners.setdefault(name, {}).update(dict.fromkeys(slot_ids, peer))

    def disown(self, name: str, slot_ids: Sequence[int]) -> None:
        """The slots were released."""
        owners = self._owners.get(name)
        if owners:
            for s in slot_ids:
                owners.pop(s, None)

    def void(self, name: str) -> None:
        """Every slot of ``name`` was voided (a version recovered): nobody holds any."""
        self._owners.pop(name, None)

    def take_peer(self, peer: Any) -> dict[str, list[int]]:
        """The slots ``peer`` held, by admission, which nobody holds any more."""
        out = {}
        for name, owners in self._owners.items():
            mine = [s for s, o in owners.items() if o == peer]
            for s in mine:
                del owners[s]
            if mine:
                out[name] = mine
        return out
