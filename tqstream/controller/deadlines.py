"""The controller's deadlines in one :class:`DeadlineHeap` (owned: the heap, its sweeping, its
order).

Every deadline (lease expiry, uncommitted put, parked get, acquire or put waiting for room, a
partition's ttl) sits in one heap; the service keeps a single timer at
:meth:`~tqstream.controller.state.ControllerState.next_deadline` and calls
:meth:`~tqstream.controller.state.ControllerState.expire` when it fires, so nothing polls; the state
hands each due entry to the part that owns its kind. Entries of things that ended early are
deleted lazily, and swept out whenever the heap reaches twice its live size.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from tqstream.controller.records import COMPACT_MIN, DeadlineKind

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

    def __getstate__(self) -> dict[str, Any]:
        """For a journal's snapshot: everything but ``live`` (its owner binds it again)."""
        return {k: v for k, v in self.__dict__.items() if k != "_live"}

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
