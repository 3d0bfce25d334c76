"""The controller's deadline heap: earliest first, ties in the order added, stale entries swept."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.records import COMPACT_MIN


@settings(max_examples=200, deadline=None)
@given(
    adds=st.lists(st.tuples(st.integers(0, 20), st.booleans()), max_size=60),
    now=st.integers(-1, 21),
)
def test_due_entries_come_earliest_first_ties_in_order(
    adds: list[tuple[int, bool]], now: int
) -> None:
    heap = DeadlineHeap(lambda deadline, kind, ref: True)
    for i, (deadline, lease) in enumerate(adds):
        heap.add(float(deadline), "lease" if lease else "put", i)
    expected = sorted(
        ((float(d), "lease" if lease else "put", i) for i, (d, lease) in enumerate(adds)),
        key=lambda e: (e[0], e[2]),
    )
    due = list(heap.due(float(now)))
    assert due == [e for e in expected if e[0] <= now]
    assert len(heap) == len(adds) - len(due)
    rest = sorted(heap.entries(), key=lambda e: (e[0], e[2]))
    assert rest == [e for e in expected if e[0] > now]
    assert heap.next() == (rest[0][0] if rest else None)


def test_ended_entries_are_swept_once_the_heap_doubles() -> None:
    ended: set[int] = set()
    heap = DeadlineHeap(lambda deadline, kind, ref: ref not in ended)
    for i in range(8 * COMPACT_MIN):
        heap.add(1.0 + i, "put", i)
        ended.add(i)  # each ends before its deadline: a stale entry
    assert len(heap) < 2 * COMPACT_MIN  # not 8 * COMPACT_MIN
    heap.add(0.5, "put", -1)  # a live one survives every sweep
    for i in range(4 * COMPACT_MIN):
        heap.add(1e6 + i, "put", 10**6 + i)
        ended.add(10**6 + i)
    assert heap.next() == 0.5
