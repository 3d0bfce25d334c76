"""A ready view against a plain model: whatever rows are added, leased (removed), given back and
forgotten (a row forgotten is gone: its id never comes back), in whatever order and batch, it serves
the same rows in the same order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.controller import views
from tqstream.controller.views import ReadyView

Op = tuple[str, list[int]]
ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "lease_oldest", "remove", "forget"]),
        st.lists(st.integers(0, 30), max_size=12),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_ready_view_serves_what_a_plain_model_does(steps: list[Op]) -> None:
    check(steps)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_ready_view_on_its_array_paths_serves_the_same(steps: list[Op]) -> None:
    """Every operation on its array path (taken for many rows at once)."""
    small = views.SMALL
    views.SMALL = 0
    try:
        check(steps)
    finally:
        views.SMALL = small


def check(steps: list[Op]) -> None:
    view = ReadyView("t", 1)
    seq_of: dict[int, int] = {}  # the model: each row's place while it lives
    ready: set[int] = set()
    gone: set[int] = set()
    seq = 0
    for op, rows in steps:
        if op == "add":
            for row in rows:
                if row in gone:
                    continue
                seq += 1
                view.add(row, seq)
                seq_of.setdefault(row, seq)
                ready.add(row)
        elif op == "lease_oldest":  # what a get does: the oldest n, removed in order
            n = len(rows)
            oldest = view.oldest(n)
            assert oldest == sorted(ready, key=seq_of.__getitem__)[:n]
            view.remove(oldest)
            ready.difference_update(oldest)
        elif op == "remove":  # any rows, in any order, leased or not (no repeats: a lease's)
            view.remove(list(dict.fromkeys(rows)))
            ready.difference_update(rows)
        else:
            view.forget(list(dict.fromkeys(rows)))
            for row in rows:
                seq_of.pop(row, None)
                ready.discard(row)
                gone.add(row)
        assert len(view) == len(ready)
        assert view.oldest(len(ready)) == sorted(ready, key=seq_of.__getitem__)
