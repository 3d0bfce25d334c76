"""Deadlines inside the controller state — a mixin of
:class:`~tqstream.controller.state.ControllerState`, split out to keep each file one concept.

Every deadline (lease expiry, uncommitted put, parked get, acquire or put waiting for room, a
partition's ttl) sits in one heap; the service keeps a single timer at :meth:`next_deadline` and
calls :meth:`expire` when it fires, so nothing polls. Entries of things that ended early are
deleted lazily, and swept out whenever the heap reaches twice its live size.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

from tqstream.controller.partition import Partition
from tqstream.controller.records import (
    COMPACT_MIN,
    DeadlineKind,
    Effects,
    Finished,
    Lease,
    LeaseEnd,
    Parked,
    PendingPut,
    PutEnd,
)
from tqstream.protocol.messages import Acquire, PreparePut


class Deadlines:
    partitions: dict[str, Partition]
    pending: dict[int, PendingPut]
    leases: dict[int, Lease]
    parked: dict[str, dict[Any, Parked]]
    waiting_puts: dict[Any, tuple[PreparePut, float, int | None]]
    waiting_acquires: dict[Any, tuple[Acquire, float]]
    finished_puts: Finished[PutEnd]
    now: float
    _deadlines: list[tuple[float, int, DeadlineKind, Any]]
    _compact_at: int
    _ids: itertools.count[int]

    if TYPE_CHECKING:

        def _rollback(self, put: PendingPut, effects: Effects) -> None: ...
        def _evict(
            self, p: Partition, row_ids: list[int], effects: Effects, order: bool = True
        ) -> list[Any]: ...
        def _end_lease(self, lease: Lease, status: LeaseEnd) -> None: ...
        def _serve_parked(self, partition: str, effects: Effects, now: float) -> None: ...
        def _timeout_error(self, p: Partition, req: Any) -> Any: ...
        def _acquire_timeout(self, req: Acquire, waited: float) -> Any: ...
        def _capacity_error(self, req: PreparePut, waited: float) -> Any: ...

    def _at(self, deadline: float, kind: DeadlineKind, ref: Any) -> None:
        heapq.heappush(self._deadlines, (deadline, next(self._ids), kind, ref))
        if len(self._deadlines) >= self._compact_at:
            self._compact()

    def _compact(self) -> None:
        """Drop the entries of leases, puts and waits that ended before their deadline (the heap
        deletes lazily): the heap stays within twice its live entries, at amortised O(1) a push."""
        self._deadlines = [e for e in self._deadlines if self._live(e)]
        heapq.heapify(self._deadlines)
        self._compact_at = max(COMPACT_MIN, 2 * len(self._deadlines))

    def _live(self, entry: tuple[float, int, DeadlineKind, Any]) -> bool:
        deadline, _, kind, ref = entry
        if kind == "lease":
            lease = self.leases.get(ref)
            return lease is not None and lease.deadline == deadline
        if kind == "acquire":
            return ref in self.waiting_acquires
        if kind == "putwait":
            return ref in self.waiting_puts
        if kind == "put":
            return ref in self.pending
        if kind == "ttl":
            return self.partitions.get(ref[0].name) is ref[0]
        return self.parked.get(ref.req.partition, {}).get(ref.handle) is ref

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> Effects:
        self.now = max(self.now, now)
        effects = Effects()
        touched: set[str] = set()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, kind, ref = heapq.heappop(self._deadlines)
            if kind == "lease":
                lease = self.leases.get(ref)
                if lease is not None and lease.deadline == deadline:
                    p = self.partitions[lease.partition]
                    p.release(lease.task, sorted(lease.rows))
                    self._end_lease(lease, "expired")
                    touched.add(lease.partition)
            elif kind == "acquire":
                waited = self.waiting_acquires.pop(ref, None)
                if waited is not None:
                    effects.failed.append((ref, self._acquire_timeout(waited[0], now - waited[1])))
            elif kind == "putwait":
                put_wait = self.waiting_puts.pop(ref, None)
                if put_wait is not None:
                    error = self._capacity_error(put_wait[0], now - put_wait[1])
                    effects.failed.append((ref, error))
            elif kind == "ttl":
                owner: Partition = ref[0]
                if self.partitions.get(owner.name) is owner:  # not cleared and re-created since
                    owner.expired += len(self._evict(owner, ref[1], effects))
            elif kind == "put":
                put = self.pending.pop(ref, None)
                if put is not None:
                    self.finished_puts.end(ref, "cleared" if put.cancelled else "expired")
                    self._rollback(put, effects)
            else:
                parked: Parked = ref
                if parked.req.partition in touched:  # rows given back before this timeout
                    touched.discard(parked.req.partition)
                    self._serve_parked(parked.req.partition, effects, now)
                waiting = self.parked.get(parked.req.partition, {})
                if waiting.get(parked.handle) is parked:
                    del waiting[parked.handle]
                    p = self.partitions[parked.req.partition]
                    effects.failed.append((parked.handle, self._timeout_error(p, parked.req)))
        for name in touched:
            self._serve_parked(name, effects, now)
        return effects
