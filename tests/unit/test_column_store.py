"""ColumnStore: chunked columnar storage, zero-copy fetches, drop semantics, byte accounting."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tqstream.convert.inputs import columns_from_data
from tqstream.errors import (
    BatchShapeError,
    FieldExistsError,
    InvalidRequestError,
    SchemaError,
    StaleRowError,
    UnknownRowError,
)
from tqstream.protocol.columns import Column
from tqstream.protocol.wire import column_from_wire, column_to_wire
from tqstream.storage import rowmap
from tqstream.storage.columns import ColumnStore


def value(field: str, row: int, chunk: int):
    """The deterministic content of (row, field) written by ``chunk``."""
    if field == "d":
        return [row, chunk]
    if field == "r":
        return list(range(row % 4)) + [chunk] * (row % 3)
    return f"{row}:{chunk}" * (row % 3)


def make_columns(fields, rows: list[int], chunk: int) -> dict[str, Column]:
    data = {
        "d": torch.tensor([value("d", r, chunk) for r in rows], dtype=torch.int64),
        "r": [torch.tensor(value("r", r, chunk), dtype=torch.float32) for r in rows],
        "o": [value("o", r, chunk) for r in rows],
    }
    columns = columns_from_data({f: data[f] for f in fields})[1]
    # as a unit holds them: a field's values in one tensor (one frame or region), not the rows put
    return {name: Column(c.schema, c.values, c.offsets) for name, c in columns.items()}


def content(col: Column) -> list:
    if col.schema.kind == "dense":
        return col.values.tolist()
    o = col.offsets.tolist()
    if col.schema.kind == "ragged":
        return [col.values[o[i] : o[i + 1]].tolist() for i in range(col.n_rows)]
    data = bytes(col.values.numpy())
    return [data[o[i] : o[i + 1]].decode() for i in range(col.n_rows)]


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.fixture
def store() -> ColumnStore:
    s = ColumnStore()
    s.add_chunk("p", 1, list(range(10, 20)), make_columns("dro", list(range(10, 20)), 1))
    return s


def test_contiguous_fetch_is_a_zero_copy_slice(store):
    chunk = store._chunks[1].columns
    got = store.fetch("p", [12, 13, 14], ["d", "r", "o"])
    assert got["d"].values.data_ptr() == chunk["d"].values[2].data_ptr()
    o = chunk["r"].offsets
    assert got["r"].values.data_ptr() == chunk["r"].values[int(o[2]) :].data_ptr()
    assert all(shares(got[f].values, chunk[f].values) for f in "dro")
    assert content(got["d"]) == [value("d", r, 1) for r in (12, 13, 14)]
    assert content(got["r"]) == [value("r", r, 1) for r in (12, 13, 14)]
    assert content(got["o"]) == [value("o", r, 1) for r in (12, 13, 14)]
    whole = store.fetch("p", list(range(10, 20)), ["d"])["d"]
    assert whole.values.data_ptr() == chunk["d"].values.data_ptr()


def test_scattered_fetch_gathers(store):
    rows = [17, 11, 11, 14]
    got = store.fetch("p", rows, ["d", "r", "o"])
    assert not shares(got["d"].values, store._chunks[1].columns["d"].values)
    for f in "dro":
        assert content(got[f]) == [value(f, r, 1) for r in rows]
    assert store.fetch("p", [], ["r"])["r"].n_rows == 0


def test_fields_from_two_chunks_and_rows_across_chunks(store):
    rows = [19, 15, 10, 12]  # a later put_fields, in another order
    store.add_chunk("p", 2, rows, {"x": make_columns("r", rows, 2)["r"]})
    store.add_chunk("p", 3, [20, 21], make_columns("dro", [20, 21], 3))
    got = store.fetch("p", [12, 10], ["d", "x"])
    assert content(got["d"]) == [value("d", 12, 1), value("d", 10, 1)]
    assert content(got["x"]) == [value("r", 12, 2), value("r", 10, 2)]
    rows = [18, 19, 20, 21, 10]
    got = store.fetch("p", rows, ["o", "r"])
    assert content(got["o"]) == [value("o", r, 1 if r < 20 else 3) for r in rows]
    interleaved = [10, 20, 11, 21, 12, 20, 13]  # many more runs than chunks
    got = store.fetch("p", interleaved, ["r", "d"])
    assert content(got["r"]) == [value("r", r, 1 if r < 20 else 3) for r in interleaved]
    assert content(got["d"]) == [value("d", r, 1 if r < 20 else 3) for r in interleaved]


def test_unknown_rows_and_fields(store):
    with pytest.raises(UnknownRowError) as info:
        store.fetch("p", [10, 3, 11, 4, 5, 6, 7, 8], ["d"])
    assert str(info.value) == (
        "6 of the 8 requested rows of partition 'p' (row ids 3, 4, 5, 6, 7, ...) have no field "
        "'d' on this storage unit: they were cleared (or never written) after the metadata was "
        "obtained; fetch fresh metadata with get_meta or get_by_keys"
    )
    assert info.value.details == {
        "partition": "p", "field": "d", "missing": 6, "rows": [3, 4, 5, 6, 7],
    }  # fmt: skip
    with pytest.raises(UnknownRowError, match=r"^2 of the 2 requested rows of partition 'q' \("):
        store.fetch("q", [10, 11], ["d"])
    with pytest.raises(UnknownRowError, match=r"^1 of the 1 requested rows .* have no field 'x'"):
        store.fetch("p", [10], ["x"])
    with pytest.raises(UnknownRowError, match=r"^no row of partition 'p' has field 'x' on this"):
        store.fetch("p", [], ["x"])


def test_add_chunk_validation_is_atomic(store):
    before = (store.bytes, store.chunks, store.rows)
    cols = make_columns("dr", [20, 21], 9)
    cases = [
        (2, [20, 20], cols, InvalidRequestError,
         "chunk 2 of partition 'p' lists row ids more than once (20); each row appears once per "
         "chunk"),
        (1, [20, 21], cols, InvalidRequestError,
         "chunk 1 of partition 'p': chunk id 1 is already stored; chunk ids are unique per put "
         "segment, so the same Store must not be applied twice"),
        (2, [20, 21, 22], cols, BatchShapeError,
         "chunk 2 of partition 'p': column 'd' has 2 rows but the chunk lists 3 row ids; every "
         "column of a chunk has one entry per row"),
        (2, [], {}, BatchShapeError,
         "chunk 2 of partition 'p' is empty (0 rows, 0 fields); a chunk needs at least one row "
         "and one field"),
        (2, [20, 11], {"x": cols["d"], "o": make_columns("o", [20, 11], 9)["o"]},
         FieldExistsError,
         "chunk 2 of partition 'p': field 'o' is already stored for 1 of its 2 rows (row ids 11); "
         "a field is written once per row, put_fields may only add fields the rows do not have "
         "yet"),
        (2, [20, 21], {"d": make_columns("r", [20, 21], 9)["r"]}, SchemaError,
         "chunk 2 of partition 'p': field 'd' is stored as dense int64[2], the chunk offers "
         "ragged float32[*]; write the field with its existing schema"),
    ]  # fmt: skip
    for chunk, rows, columns, error, message in cases:
        with pytest.raises(error) as info:
            store.add_chunk("p", chunk, rows, columns)
        assert str(info.value) == message
        assert (store.bytes, store.chunks, store.rows) == before
    for field in ("d", "x"):  # nothing of the failed chunks was stored
        with pytest.raises(UnknownRowError):
            store.fetch("p", [20], [field])


def test_drop_rows_releases_a_chunk_with_its_last_row(store):
    rows = [10, 11, 12]
    store.add_chunk("p", 2, rows, {"x": make_columns("o", rows, 2)["o"]})
    size1 = store._chunks[1].nbytes
    size2 = store._chunks[2].nbytes
    assert store.bytes == size1 + size2 and store.chunks == 2 and store.rows == 10
    assert store.drop_rows("p", [10, 11, 10, 99]) == 2  # duplicates and unknown rows ignored
    assert store.bytes == size1 + size2 and store.rows == 8
    with pytest.raises(UnknownRowError):
        store.fetch("p", [10], ["x"])
    assert store.drop_rows("p", [10, 11]) == 0 and store.drop_rows("nope", [1]) == 0
    assert store.drop_rows("p", [12]) == 1  # the last row of chunk 2, with all its fields
    assert store.bytes == size1 and store.chunks == 1
    with pytest.raises(UnknownRowError, match="no row of partition 'p' has field 'x'"):
        store.fetch("p", [], ["x"])
    assert store.drop_rows("p", range(13, 20)) == 7
    assert store.bytes == 0 and store.chunks == 0 and store.rows == 0


def test_drop_chunks_aborts_only_that_put(store):
    store.add_chunk("p", 2, [11, 12], {"x": make_columns("d", [11, 12], 2)["d"]})
    store.add_chunk("p", 3, [30], make_columns("d", [30], 3))
    store.drop_chunks([2, 3, 77])
    assert store.chunks == 1 and store.rows == 10 and store.bytes == store._chunks[1].nbytes
    assert content(store.fetch("p", [11], ["d"])["d"]) == [value("d", 11, 1)]
    with pytest.raises(UnknownRowError):
        store.fetch("p", [11], ["x"])
    store.add_chunk("p", 4, [11, 12], {"x": make_columns("r", [11, 12], 4)["r"]})  # new schema ok
    store.drop_rows("p", [11])
    store.drop_chunks([1])
    assert store.chunks == 1 and store.rows == 1
    store.drop_partition("p")
    store.drop_partition("p")
    assert store.bytes == 0 and store.chunks == 0 and store.rows == 0


def test_chunk_dropped_before_it_arrives_is_refused(store):
    """An aborted put's Store can arrive after the drop order: it must not be kept."""
    store.drop_chunks([42])
    with pytest.raises(InvalidRequestError, match="arrived after its put was rolled back"):
        store.add_chunk("p", 42, [50], make_columns("d", [50], 42))
    assert store.chunks == 1 and store.rows == 10


def test_rows_are_served_to_reads_of_their_generation_only():
    """A row is (row id, generation): a read of an earlier generation is refused, a write of one
    too; a newer generation's first write drops the older rows (a schema of theirs with them),
    even when the same row ids come back with other bytes."""
    released: list[int] = []
    s = ColumnStore(on_release=lambda chunk, held: released.append(chunk))
    rows = list(range(4))
    s.add_chunk("p", 1, rows, make_columns("d", rows, 1), generation=7)
    assert content(s.fetch("p", rows, ["d"], 7)["d"]) == [value("d", r, 1) for r in rows]
    with pytest.raises(StaleRowError) as info:
        s.fetch("p", [2, 3], ["d"], 6)
    assert str(info.value) == (
        "a read of 2 rows of partition 'p' (row ids 2, 3) names generation 6, but this storage "
        "unit holds the partition's rows of generation 7: the batch's metadata is of an earlier "
        "incarnation of the partition, cleared or restored since it was obtained, and its row ids "
        "may name other samples now; nothing was read: get fresh metadata (get_meta, get_by_keys)"
    )
    assert info.value.details == {
        "partition": "p", "rows": [2, 3], "count": 2, "generation": 6, "held": 7,
    }  # fmt: skip
    with pytest.raises(UnknownRowError) as unknown:  # a newer one's rows: not here yet
        s.fetch("p", rows, ["d"], 8)
    assert not isinstance(unknown.value, StaleRowError)
    with pytest.raises(StaleRowError, match="while the write was in flight; nothing was stored"):
        s.add_chunk("p", 2, [9], make_columns("d", [9], 2), generation=6)
    assert s.chunks == 1 and not released
    newer = {"d": make_columns("r", rows, 3)["r"]}  # field d, of another schema now
    s.add_chunk("p", 3, rows, newer, generation=8)
    assert released == [1] and s.chunks == 1 and s.rows == 4
    assert content(s.fetch("p", rows, ["d"], 8)["d"]) == [value("r", r, 3) for r in rows]
    with pytest.raises(StaleRowError):
        s.fetch("p", rows, ["d"], 7)
    assert s.stale("p", 7) and not s.stale("p", 8) and not s.stale("q", 0)
    s.drop_rows("p", rows)  # all gone: the partition, and its generation, are forgotten
    s.add_chunk("p", 4, rows, make_columns("d", rows, 4), generation=7)
    assert content(s.fetch("p", rows, ["d"], 7)["d"]) == [value("d", r, 4) for r in rows]


def test_released_chunks_free_their_frames():
    col = make_columns("d", [1, 2], 1)["d"]
    ref, frames = column_to_wire("d", col, 1)
    frame = np.frombuffer(bytes(frames[0]), dtype=np.uint8).copy()
    alive = weakref.ref(frame)
    store = ColumnStore()
    store.add_chunk("p", 1, [1, 2], {"d": column_from_wire(ref, [b"h", frame], 2)})
    del frame
    got = store.fetch("p", [2], ["d"])
    store.drop_rows("p", [1, 2])
    gc.collect()
    assert alive() is not None  # the fetched slice still pins it
    assert content(got["d"]) == [value("d", 2, 1)]
    del got
    gc.collect()
    assert alive() is None


class StoreMachine(RuleBasedStateMachine):
    """Random add/fetch/drop interleavings against a plain Python model."""

    def __init__(self) -> None:
        super().__init__()
        self.store = ColumnStore()
        self.model: dict[str, dict[int, dict[str, int]]] = {
            "a": {},
            "b": {},
        }  # row -> field -> chunk
        self.live: dict[int, tuple[str, int, set[int]]] = {}  # chunk -> (partition, bytes, rows)
        self.staged: dict[int, tuple[str, list[int]]] = {}  # overwrite chunk -> (field, rows)
        self.next_chunk = 1
        self.next_row = 0

    def _add(self, partition: str, rows: list[int], fields: str) -> None:
        chunk, self.next_chunk = self.next_chunk, self.next_chunk + 1
        columns = make_columns(fields, rows, chunk)
        renamed = {f"f{f}": col for f, col in columns.items()}
        self.store.add_chunk(partition, chunk, rows, renamed)
        for r in rows:
            self.model[partition].setdefault(r, {}).update(dict.fromkeys(renamed, chunk))
        nbytes = sum(c.nbytes for c in renamed.values())
        self.live[chunk] = (partition, nbytes, set(rows))

    @rule(
        partition=st.sampled_from("ab"),
        n=st.integers(1, 6),
        fields=st.sampled_from(["d", "ro", "dro"]),
    )
    def put(self, partition, n, fields):
        rows = list(range(self.next_row, self.next_row + n))
        self.next_row += n
        self._add(partition, rows, fields)

    @rule(partition=st.sampled_from("ab"), field=st.sampled_from("dro"), data=st.data())
    def put_fields(self, partition, field, data):
        lacking = [r for r, fs in self.model[partition].items() if f"f{field}" not in fs]
        if lacking:
            rows = data.draw(st.lists(st.sampled_from(lacking), min_size=1, unique=True))
            self._add(partition, rows, field)

    @rule(partition=st.sampled_from("ab"), field=st.sampled_from("dro"), data=st.data())
    def overwrite(self, partition, field, data):
        """Values for rows of which some have the field: staged for those until published."""
        if not self.model[partition]:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.model[partition])), min_size=1,
                                  unique=True))  # fmt: skip
        chunk, self.next_chunk = self.next_chunk, self.next_chunk + 1
        name = f"f{field}"
        column = make_columns(field, rows, chunk)[field]
        self.store.add_chunk(partition, chunk, rows, {name: column}, overwrite=True)
        staged = [r for r in rows if name in self.model[partition][r]]
        for r in rows:
            self.model[partition][r].setdefault(name, chunk)
        self.live[chunk] = (partition, column.nbytes, set(rows))
        if staged:
            self.staged[chunk] = (name, staged)

    @precondition(lambda self: self.staged)
    @rule(data=st.data())
    def publish(self, data):
        chunk = data.draw(st.sampled_from(sorted(self.staged)))
        self.store.publish(chunk)
        name, rows = self.staged.pop(chunk)
        partition, _, held = self.live[chunk]
        for r in rows:
            if r not in held:
                continue  # dropped since
            # the chunk holding the old value may have been dropped since (the field went with it)
            old = self.model[partition][r].get(name)
            self.model[partition][r][name] = chunk
            if old is not None and old not in self.model[partition][r].values():
                self._drop_from(old, r)

    @rule(partition=st.sampled_from("ab"), field=st.sampled_from("dro"), data=st.data())
    def fetch(self, partition, field, data):
        name = f"f{field}"
        held = sorted(r for r, fs in self.model[partition].items() if name in fs)
        if not held:
            return
        rows = data.draw(st.one_of(
            st.lists(st.sampled_from(held), max_size=8),
            st.integers(0, len(held) - 1).map(lambda i: held[i : i + 3]),
        ))  # fmt: skip
        got = self.store.fetch(partition, rows, [name])[name]
        chunks = [self.model[partition][r][name] for r in rows]
        assert content(got) == [value(field, r, c) for r, c in zip(rows, chunks, strict=True)]

    @rule(partition=st.sampled_from("ab"), data=st.data())
    def drop_rows(self, partition, data):
        rows = data.draw(st.lists(st.integers(0, self.next_row + 2), max_size=6))
        expected = len({r for r in rows if r in self.model[partition]})
        assert self.store.drop_rows(partition, rows) == expected
        for r in rows:
            self.model[partition].pop(r, None)
            holding = [c for c, (p, _, held) in self.live.items() if p == partition and r in held]
            for chunk in holding:
                self._drop_from(chunk, r)

    def _drop_from(self, chunk: int, row: int) -> None:
        self.live[chunk][2].discard(row)
        if not self.live[chunk][2]:
            del self.live[chunk]
            self.staged.pop(chunk, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def drop_chunk(self, data):
        chunk = data.draw(st.sampled_from(sorted(self.live)))
        self.store.drop_chunks([chunk])
        self.staged.pop(chunk, None)
        partition, _, rows = self.live.pop(chunk)
        for r in rows:
            fields = self.model[partition][r]
            for f in [f for f, c in fields.items() if c == chunk]:
                del fields[f]
            if not any(r in held for p, _, held in self.live.values() if p == partition):
                del self.model[partition][r]

    @rule(partition=st.sampled_from("ab"))
    def drop_partition(self, partition):
        self.store.drop_partition(partition)
        self.model[partition] = {}
        self.live = {c: v for c, v in self.live.items() if v[0] != partition}
        self.staged = {c: v for c, v in self.staged.items() if c in self.live}

    @invariant()
    def accounting(self):
        assert self.store.bytes == sum(nbytes for _, nbytes, _ in self.live.values())
        assert self.store.chunks == len(self.live)
        held = {(p, r) for p, _, rows in self.live.values() for r in rows}
        assert self.store.rows == len(held) == sum(len(rows) for rows in self.model.values())


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


class SpanStoreMachine(StoreMachine):
    """The same with consecutive rows passed as ranges, so that the index keeps every run of two
    rows or more as one span (a put's rows, a run of new fields), and runs put below rows already
    held (into gaps left by earlier puts)."""

    def __init__(self) -> None:
        super().__init__()
        self.span_min, rowmap.SPAN_MIN = rowmap.SPAN_MIN, 1
        self.gaps: list[range] = []

    def teardown(self) -> None:
        rowmap.SPAN_MIN = self.span_min

    def _add(self, partition: str, rows, fields: str) -> None:
        if len(rows) > 1 and list(rows) == list(range(rows[0], rows[-1] + 1)):
            rows = range(rows[0], rows[-1] + 1)
        super()._add(partition, rows, fields)

    @rule(partition=st.sampled_from("ab"), n=st.integers(2, 6), gap=st.integers(2, 6))
    def put_after_a_gap(self, partition, n, gap):
        self.gaps.append(range(self.next_row, self.next_row + gap))
        self.next_row += gap
        self.put(partition, n, "dro")

    @precondition(lambda self: self.gaps)
    @rule(partition=st.sampled_from("ab"))
    def fill_a_gap(self, partition):
        self._add(partition, self.gaps.pop(), "dro")


TestSpanStoreMachine = SpanStoreMachine.TestCase
TestSpanStoreMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_reset_drops_older_chunks_and_refuses_them_later(store):
    # the unit was declared lost and revived: chunks of puts placed before (ids < 5) are dropped,
    # and a store of one that arrives after the reset is refused (its put was rolled back)
    store.add_chunk("q", 6, [0, 1], make_columns("d", [0, 1], 6))
    store.reset(5)
    assert store.chunks == 1 and store.holds(6)
    with pytest.raises(InvalidRequestError, match="declared lost and revived"):
        store.add_chunk("p", 4, [30], make_columns("d", [30], 4))
    store.add_chunk("p", 7, [30], make_columns("d", [30], 7))
    assert store.chunks == 2


def test_an_overwrite_is_staged_until_published(store):
    rows = [10, 11, 12]
    store.add_chunk("p", 2, rows, make_columns("d", rows, 2), overwrite=True)
    assert content(store.fetch("p", rows, ["d"])["d"]) == [value("d", r, 1) for r in rows]
    store.publish(2)
    assert content(store.fetch("p", rows, ["d"])["d"]) == [value("d", r, 2) for r in rows]
    assert content(store.fetch("p", [13], ["d"])["d"]) == [value("d", 13, 1)]
    # chunk 1 still holds r and o of rows 10-12: it keeps them until they are dropped
    assert store.holds(1) and store.chunks == 2
    store.drop_rows("p", rows)  # each row's fields are dropped from the chunk holding them
    assert content(store.fetch("p", [14], ["d", "r"])["d"]) == [value("d", 14, 1)]
    with pytest.raises(UnknownRowError):
        store.fetch("p", [10], ["d"])


def test_a_rolled_back_overwrite_leaves_the_old_values(store):
    held = store.bytes
    store.add_chunk("p", 2, [10, 11], make_columns("do", [10, 11], 2), overwrite=True)
    store.drop_chunks([2])
    assert store.bytes == held and not store.holds(2)
    got = store.fetch("p", [10, 11], ["d", "o"])
    assert content(got["d"]) == [value("d", r, 1) for r in (10, 11)]
    assert content(got["o"]) == [value("o", r, 1) for r in (10, 11)]
    store.publish(2)  # a publish of a chunk dropped meanwhile does nothing


def test_a_chunk_whose_every_field_was_replaced_is_released(store):
    rows = list(range(10, 20))
    store.add_chunk("p", 2, rows, make_columns("dro", rows, 2), overwrite=True)
    assert store.holds(1)
    store.publish(2)
    assert not store.holds(1) and store.chunks == 1
    assert content(store.fetch("p", rows, ["r"])["r"]) == [value("r", r, 2) for r in rows]
    store.drop_rows("p", rows)
    assert store.bytes == 0 and store.chunks == 0


def test_an_overwrite_adding_new_rows_indexes_them_at_once(store):
    store.add_chunk("p", 2, [19, 20], make_columns("d", [19, 20], 2), overwrite=True)
    assert content(store.fetch("p", [19, 20], ["d"])["d"]) == [value("d", 19, 1), value("d", 20, 2)]
    store.publish(2)
    assert content(store.fetch("p", [19, 20], ["d"])["d"]) == [value("d", 19, 2), value("d", 20, 2)]


def test_publishing_an_overwrite_after_the_old_chunk_was_dropped():
    # the old value's chunk goes first (dropped while the overwrite was staged): publishing the
    # overwrite makes its value the row's, and the store's accounting holds only what is live
    s = ColumnStore()
    s.add_chunk("b", 1, [0, 1], make_columns("d", [0, 1], 1))
    assert s.drop_rows("b", [0]) == 1
    s.add_chunk("b", 2, [1], make_columns("d", [1], 2), overwrite=True)
    s.drop_chunks([1])
    s.publish(2)
    assert content(s.fetch("b", [1], ["d"])["d"]) == [value("d", 1, 2)]
    assert (s.chunks, s.rows) == (1, 1)
