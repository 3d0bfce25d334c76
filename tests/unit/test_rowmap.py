"""RowMap and RunPositions (the storage unit's index of runs of rows) against plain dicts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.protocol.messages import HeldRows
from tqstream.storage import rowmap
from tqstream.storage.rowmap import RowMap, RunPositions

ROWS = st.integers(0, 40)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("run"), ROWS, st.integers(0, 12), st.integers(0, 3)),
        st.tuples(st.just("set"), ROWS, st.integers(0, 3)),
        st.tuples(st.just("pop"), ROWS),
        st.tuples(st.just("del"), ROWS),
        st.tuples(st.just("pop_many"), st.lists(ROWS, max_size=6, unique=True)),
        st.tuples(st.just("drop_if"), st.lists(ROWS, max_size=6), st.integers(0, 3)),
        st.tuples(st.just("set_many"), st.lists(ROWS, max_size=6), st.integers(0, 3)),
    ),
    max_size=60,
)


@pytest.fixture(autouse=True)
def short_spans(monkeypatch):
    monkeypatch.setattr(rowmap, "SPAN_MIN", 1)  # runs of 2 rows or more become spans


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_a_row_map_is_a_dict(ops):
    m: RowMap[int] = RowMap()
    model: dict[int, int] = {}
    for op in ops:
        match op:
            case ("run", start, n, v):
                rows = range(start, start + n)
                m.set_run(rows, v)
                model.update(dict.fromkeys(rows, v))
            case ("set", row, v):
                m[row] = v
                model[row] = v
            case ("pop", row):
                assert m.pop(row, "none") == model.pop(row, "none")
            case ("pop_many", rows):
                assert m.pop_many(rows) == [model.pop(r, None) for r in rows]
            case ("drop_if", rows, v):
                m.drop_if(rows, v)
                for r in rows:
                    if model.get(r) == v:
                        del model[r]
            case ("set_many", rows, v):
                m.set_run(rows, v)
                model.update(dict.fromkeys(rows, v))
            case ("del", row):
                if row in model:
                    del m[row]
                    del model[row]
                else:
                    with pytest.raises(KeyError):
                        del m[row]
        assert len(m) == len(model) and bool(m) == bool(model)
        assert sorted(m) == sorted(model) == m.ids().tolist()
        probe = list(range(-1, 55))
        assert [m.get(r) for r in probe] == [model.get(r) for r in probe]
        assert m.get_many(probe) == [model.get(r) for r in probe]
        assert [r in m for r in probe] == [r in model for r in probe]
        for start, n in ((0, 5), (20, 30), (45, 3)):
            rows = range(start, start + n)
            assert m.disjoint(rows) == model.keys().isdisjoint(rows)
    for row in list(model):  # emptied, it holds nothing: no span, no tombstone
        del m[row]
    assert len(m) == 0 and not m._spans and not m._dict


def test_a_long_run_is_one_span_not_a_dict_entry_per_row(monkeypatch):
    monkeypatch.setattr(rowmap, "SPAN_MIN", 64)
    m: RowMap[str] = RowMap()
    m.set_run(range(1_000, 1_000_000), "chunk")
    assert len(m) == 999_000 and not m._dict and len(m._spans) == 1
    m.set_run(range(10), "small")  # a short run: dict entries
    assert len(m._dict) == 10
    del m[5_000]
    assert m.get(5_000) is None and m.get(5_001) == "chunk" and len(m) == 999_009


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50), st.integers(1, 30), st.lists(st.integers(0, 90), max_size=40))
def test_run_positions_are_a_dict(first, n, removed):
    pos = RunPositions(first, n)
    model = {r: r - first for r in range(first, first + n)}
    for r in removed:
        if r in model:
            del pos[r], model[r]
        else:
            with pytest.raises(KeyError):
                del pos[r]
    assert dict((r, pos[r]) for r in pos) == model and len(pos) == len(model)
    assert [r in pos for r in range(-1, 95)] == [r in model for r in range(-1, 95)]
    assert bool(pos) == bool(model)


@given(st.lists(st.integers(0, 200), unique=True))
def test_the_rows_a_unit_holds_go_as_runs_and_come_back_the_same(rows):
    ids = np.array(sorted(rows), dtype=np.int64)
    held = HeldRows.of("p", 3, ids)
    assert len(held.runs) == 2 * (len(rows) and 1 + int((np.diff(ids) != 1).sum()))
    assert held.row_ids().tolist() == sorted(rows) and held.count() == len(rows)
