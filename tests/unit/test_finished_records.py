"""The records of ended puts and leases: a bounded map of id -> status, 9 bytes an id."""

from __future__ import annotations

from collections import OrderedDict
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.controller.records import FINISHED_LIMIT, Finished, LeaseEnd, PutEnd

STATUSES = get_args(PutEnd)


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(1, 40),
    ends=st.lists(st.tuples(st.integers(0, 60), st.sampled_from(STATUSES)), max_size=120),
    asked=st.lists(st.integers(-1, 61), max_size=20),
)
def test_finished_answers_like_a_bounded_ordered_dict(
    limit: int, ends: list[tuple[int, PutEnd]], asked: list[int]
) -> None:
    """What the controller kept before: the newest ``limit`` ends, one entry per end (ids are
    unique there; a repeated one here answers with its newest status)."""
    records: Finished[PutEnd] = Finished(STATUSES, limit)
    model: OrderedDict[int, list[PutEnd]] = OrderedDict()
    order: list[tuple[int, PutEnd]] = []
    for key, status in ends:
        records.end(key, status)
        order.append((key, status))
        held = order[-limit:]
        model = OrderedDict()
        for k, s in held:
            model.setdefault(k, []).append(s)
        assert records.get(key) == status  # the newest is found at once
        assert len(records) == len(held)
    for key in asked + [k for k, _ in ends]:
        expected = model[key][-1] if key in model else None
        assert records.get(key) == expected


def test_finished_costs_at_most_16_bytes_an_id() -> None:
    records: Finished[LeaseEnd] = Finished(get_args(LeaseEnd))
    for lease_id in range(1, 3 * FINISHED_LIMIT):
        records.end(lease_id, "acked")
    assert len(records) == FINISHED_LIMIT
    assert records.nbytes <= 16 * FINISHED_LIMIT
    assert records.get(1) is None and records.get(3 * FINISHED_LIMIT - 1) == "acked"
    assert records.get(2 * FINISHED_LIMIT) == "acked"  # the oldest still held


def test_finished_refuses_a_status_it_was_not_built_with() -> None:
    records: Finished[PutEnd] = Finished(STATUSES, 4)
    with pytest.raises(KeyError):
        records.end(1, "acked")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Finished((), 4)
