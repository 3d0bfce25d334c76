"""The vocabulary the controller's parts share: the effects a state change returns to the service,
the one sequence of ids, and the ledger of records in flight with how the newest ended ones ended.
Each table lives with its owner: the put book in :mod:`.book`, leases in :mod:`.leases`, parked
gets in :mod:`.parked`, admissions in :mod:`.flow`. Pure data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

import msgspec
import numpy as np

from tqstream.errors import TQStreamError
from tqstream.types import BatchMeta

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

    def peek(self) -> int:
        """The next id, not taken: every id issued so far is smaller."""
        return self._next

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
