"""Deadlines inside the controller state: the :class:`DeadlineHeap` (owned: the heap, its
sweeping, its order) and the mixin of :class:`~tqstream.controller.state.ControllerState` that
says what each kind of deadline ends.

Every deadline (lease expiry, uncommitted put, parked get, acquire or put waiting for room, a
partition's ttl) sits in one heap; the service keeps a single timer at :meth:`next_deadline` and
calls :meth:`expire` when it fires, so nothing polls. Entries of things that ended early are
deleted lazily, and swept out whenever the heap reaches twice its live size.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tqstream.controller.partition import Partition
from tqstream.controller.records import (
    COMPACT_MIN,
    AdmissionTable,
    DeadlineKind,
    Effects,
    LeaseTable,
    Parked,
    ParkedGets,
    PendingPut,
    PutBook,
)
from tqstream.protocol.messages import Acquire, PreparePut

Entry = tuple[float, "DeadlineKind", Any]
"""A deadline, what it ends, and the id or record of the thing."""


class DeadlineHeap:
    """The controller's deadlines in one heap, earliest first (ties in the order added).

    ``live`` says whether an entry's thing is still there: entries of things that ended early
    stay until they come due or a sweep drops them, which happens whenever the heap reaches twice
    the live entries it had after the last sweep (amortised O(1) an entry)."""

    def __init__(self, live: Callable[[float, DeadlineKind, Any], bool]) -> None:
        self._heap: list[tuple[float, int, DeadlineKind, Any]] = []
        self._order = itertools.count()
        self._live = live
        self._sweep_at = COMPACT_MIN

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: float, kind: DeadlineKind, ref: Any) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), kind, ref))
        if len(self._heap) >= self._sweep_at:
            self._heap = [e for e in self._heap if self._live(e[0], e[2], e[3])]
            heapq.heapify(self._heap)
            self._sweep_at = max(COMPACT_MIN, 2 * len(self._heap))

    def next(self) -> float | None:
        """The earliest deadline (of a live thing or not), None when there is none."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[Entry]:
        """Take out, earliest first, the entries due at ``now`` (live or not: the caller looks)."""
        while self._heap and self._heap[0][0] <= now:
            deadline, _, kind, ref = heapq.heappop(self._heap)
            yield deadline, kind, ref

    def entries(self) -> Iterator[Entry]:
        """Every entry, in no particular order (live or not)."""
        return ((deadline, kind, ref) for deadline, _, kind, ref in self._heap)


class Deadlines:
    partitions: dict[str, Partition]
    puts: PutBook
    leases: LeaseTable
    parked: ParkedGets
    admissions: AdmissionTable
    now: float
    deadlines: DeadlineHeap

    if TYPE_CHECKING:

        def _rollback(self, put: PendingPut, effects: Effects) -> None: ...
        def _evict(
            self, p: Partition, row_ids: list[int], effects: Effects, order: bool = True
        ) -> list[Any]: ...
        def _serve_parked(self, partition: str, effects: Effects, now: float) -> None: ...
        def settle(self, effects: Effects, now: float) -> Effects: ...
        def _timeout_error(self, p: Partition, req: Any) -> Any: ...
        def _acquire_timeout(self, req: Acquire, waited: float) -> Any: ...
        def _capacity_error(self, req: PreparePut, waited: float) -> Any: ...

    def schedule(self, deadline: float, kind: DeadlineKind, ref: Any) -> None:
        self.deadlines.add(deadline, kind, ref)

    def _live(self, deadline: float, kind: DeadlineKind, ref: Any) -> bool:
        """Whether the thing a deadline ends is still there (its entry is not stale)."""
        if kind == "lease":
            lease = self.leases.get(ref)
            return lease is not None and lease.deadline == deadline
        if kind == "acquire":
            return self.admissions.parked(ref) is not None
        if kind == "putwait":
            return self.puts.parked(ref) is not None
        if kind == "put":
            return ref in self.puts
        if kind == "ttl":
            return self.partitions.get(ref[0].name) is ref[0]
        return self.parked.holds(ref)

    def next_deadline(self) -> float | None:
        return self.deadlines.next()

    def expire(self, now: float) -> Effects:
        self.now = max(self.now, now)
        effects = Effects()
        touched: set[str] = set()
        for deadline, kind, ref in self.deadlines.due(now):
            if kind == "lease":
                lease = self.leases.get(ref)
                if lease is not None and lease.deadline == deadline:
                    p = self.partitions[lease.partition]
                    p.release(lease.task, sorted(lease.rows))
                    self.leases.end(lease, "expired")
                    touched.add(lease.partition)
            elif kind == "acquire":
                waited = self.admissions.unpark(ref)
                if waited is not None:
                    effects.failed.append(
                        (ref, self._acquire_timeout(waited.req, now - waited.since))
                    )
            elif kind == "putwait":
                put_wait = self.puts.unpark(ref)
                if put_wait is not None:
                    error = self._capacity_error(put_wait.req, now - put_wait.since)
                    effects.failed.append((ref, error))
            elif kind == "ttl":
                owner: Partition = ref[0]
                if self.partitions.get(owner.name) is owner:  # not cleared and re-created since
                    owner.expired += len(self._evict(owner, ref[1], effects))
                    self.settle(effects, now)  # puts waiting for room, before their deadlines
            elif kind == "put":
                put = self.puts.get(ref)
                if put is not None:
                    self.puts.end(ref, "cleared" if put.cancelled else "expired")
                    self._rollback(put, effects)
                    self.settle(effects, now)
            else:
                parked: Parked = ref
                if parked.req.partition in touched:  # rows given back before this timeout
                    touched.discard(parked.req.partition)
                    self._serve_parked(parked.req.partition, effects, now)
                if self.parked.unpark(parked):
                    p = self.partitions[parked.req.partition]
                    effects.failed.append((parked.handle, self._timeout_error(p, parked.req)))
        effects.touched |= touched
        return self.settle(effects, now)
