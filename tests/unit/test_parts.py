"""The one-copy ragged path: a put's list of CPU tensors stays the rows (a column in parts), and
every writer copies each row once into the frame or segment that carries it.

Hypothesis checks each form against the plain torch construction (``torch.cat`` of the rows,
offsets from their lengths): every dtype tqstream carries, one row, rows of length 0, trailing
dimensions, strided, conjugated and grad-requiring rows; the joined frame, the packed frame, the
staged ``write()`` and the writer's mapping of a shared-memory segment; slices, gathers and joins of
columns in parts; and the per-token version bounds read from the rows in cache-sized windows."""

from __future__ import annotations

import os
import secrets

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import sample

from tqstream.client import versions
from tqstream.client.versions import row_versions
from tqstream.convert.inputs import columns_from_data
from tqstream.errors import SchemaError
from tqstream.protocol import parts, shm
from tqstream.protocol.columns import DTYPES, Column, dtype_name
from tqstream.protocol.messages import ColumnRef
from tqstream.protocol.parts import Parts
from tqstream.protocol.wire import column_from_wire, column_to_wire, columns_to_wire
from tqstream.types import FieldSchema

ALL = list(DTYPES.values())
INTEGERS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


@st.composite
def ragged(draw: st.DrawFn, dtypes: list[torch.dtype] = ALL) -> list[torch.Tensor]:
    """Rows as a rollout may hand them over: tensors of their own, views of one tensor, strided
    views, conjugated (complex) or requiring grad (floating)."""
    dtype = draw(st.sampled_from(dtypes))
    trailing = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=9))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1 << 16)))
    form = draw(st.sampled_from(["own", "views", "strided", "conj", "grad"]))
    if form == "views":
        whole = sample(dtype, (sum(lengths), *trailing), gen)
        return list(torch.split(whole, lengths))
    if form == "strided":  # every other value of a tensor twice as long
        return [sample(dtype, (2 * n, *trailing), gen)[::2] for n in lengths]
    rows = [sample(dtype, (n, *trailing), gen) for n in lengths]
    if form == "conj" and dtype.is_complex:
        return [r.conj() for r in rows]
    if form == "grad" and dtype.is_floating_point:
        return [r.requires_grad_() for r in rows]
    return rows


def plain(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a put of ``rows`` holds, built the plain way."""
    values = torch.cat([r.detach().resolve_conj() for r in rows])
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([r.shape[0] for r in rows]).cumsum(0)
    return values, offsets


def bits(t: torch.Tensor | memoryview | bytes | bytearray) -> bytes:
    if isinstance(t, torch.Tensor):  # strides of its own (a size-1 dimension may keep any)
        flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
        return bytes(flat.view(torch.uint8).numpy())
    return bytes(t)


def same(col: Column, values: torch.Tensor, offsets: torch.Tensor | None) -> None:
    assert col.values.dtype == values.dtype and col.values.shape == values.shape
    assert bits(col.values) == bits(values)
    if offsets is None:
        assert col.offsets is None
    else:
        assert col.offsets is not None and col.offsets.tolist() == offsets.tolist()


# --- a put's rows in every form ------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(rows=ragged(), stage=st.sampled_from([16, 64, 1 << 20]))
def test_a_put_of_rows_is_their_concatenation_in_every_form(
    rows: list[torch.Tensor], stage: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    values, offsets = plain(rows)
    n, cols = columns_from_data({"x": rows})
    col = cols["x"]
    dtype, trailing = rows[0].dtype, tuple(rows[0].shape[1:])
    assert n == len(rows) and col.n_rows == len(rows) and col.n_values == values.shape[0]
    assert col.schema == FieldSchema("ragged", dtype_name(dtype), trailing)
    assert col.nbytes == values.numel() * values.element_size() + offsets.numel() * 8
    assert col.in_parts == (len(rows) > 1)  # one row is the values (one trajectory's put)
    assert col.offsets is not None and col.offsets.tolist() == offsets.tolist()
    # frames that ZMQ sends as they are: the values joined into one buffer
    ref, frames = column_to_wire("x", col, 1)
    assert bits(frames[0]) == bits(values) and bits(frames[1]) == bits(offsets)
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(ref), type=ColumnRef)
    same(column_from_wire(ref, [b"", *map(bytes, frames)], len(rows)), values, offsets)
    # for a shared-memory writer: the rows themselves, copied into place, or staged for write()
    _, kept = column_to_wire("x", col, 1, parts=True)
    if col.in_parts:
        buffer = kept[0]
        assert isinstance(buffer, Parts) and buffer.nbytes == len(bits(values))
        assert [p.data_ptr() for p in buffer.parts] == [r.data_ptr() for r in rows]  # no copy
        out = torch.zeros(buffer.nbytes + 64, dtype=torch.uint8)
        buffer.into(out[64:])
        assert bits(out[64:]) == bits(values) and not out[:64].any()
        assert bits(buffer.join()) == bits(values)
        path = tmp_path_factory.mktemp("pwrite") / "segment"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            parts.STAGE_BYTES, saved = stage, parts.STAGE_BYTES  # windows of a few rows
            try:
                buffer.pwrite(fd, 128)
            finally:
                parts.STAGE_BYTES = saved
        finally:
            os.close(fd)
        assert path.read_bytes()[128:] == bits(values)
    # the packed frame of a small put, next to a dense field
    dense = torch.arange(len(rows) * 3, dtype=torch.int16).reshape(len(rows), 3)
    _, dcols = columns_from_data({"d": dense})
    refs, packed = columns_to_wire({"x": col, "d": dcols["d"]}, packed=True)
    assert len(packed) == 1
    back = {r.name: column_from_wire(r, [b"", bytes(packed[0])], len(rows)) for r in refs}
    same(back["x"], values, offsets)
    same(back["d"], dense, None)
    same(col, values, offsets)  # joined on demand: the same values


@settings(max_examples=60, deadline=None)
@given(rows=ragged(), mapped=st.booleans())
def test_shared_memory_writers_copy_each_row_into_the_segment(
    rows: list[torch.Tensor], mapped: bool
) -> None:
    """Through ``shm.Writer`` as a put writes a chunk: with ``write()`` (staged) or into the
    writer's own mapping of the segment (``torch.cat`` into it)."""
    values, offsets = plain(rows)
    _, cols = columns_from_data({"x": rows, "y": [r[:1] for r in rows]})
    _, buffers = columns_to_wire(cols, parts=True)
    name = f"tqs-{secrets.token_hex(8)}-d{secrets.randbits(62)}"
    writer = shm.Writer()
    saved = shm.MAPPED_WRITE_BYTES
    shm.MAPPED_WRITE_BYTES = 0 if mapped else saved
    try:
        regions, _, _ = writer.write(name, buffers, [])
        with open(os.path.join(shm.SHM_DIR, name), "rb") as f:
            data = f.read()
    finally:
        shm.MAPPED_WRITE_BYTES = saved
        writer.close()
        shm.unlink(name)
    got = [data[r.offset : r.offset + r.nbytes] for r in regions]
    assert all(r.offset % shm.ALIGN == 0 for r in regions)
    assert got[0] == bits(values) and got[1] == bits(offsets)
    first, first_offsets = plain([r[:1] for r in rows])
    assert got[2] == bits(first) and got[3] == bits(first_offsets)


# --- operations on columns in parts --------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(rows=ragged(), data=st.data())
def test_slices_gathers_and_joins_in_parts_match_the_joined_column(
    rows: list[torch.Tensor], data: st.DataObject
) -> None:
    _, cols = columns_from_data({"x": rows})
    col = cols["x"]
    joined = Column(col.schema, *plain(rows))
    n = len(rows)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    index = data.draw(st.lists(st.integers(0, n - 1), max_size=12))
    for a, b in (
        (col.slice(start, stop), joined.slice(start, stop)),
        (col.take(index), joined.take(index)),
        (col.slice(start, stop).take(list(range(stop - start))[::-1]),
         joined.slice(start, stop).take(list(range(stop - start))[::-1])),
    ):  # fmt: skip
        assert a.n_rows == b.n_rows and a.nbytes == b.nbytes
        same(a, b.values, b.offsets)
    pieces = [col.slice(0, start), joined.slice(start, stop), col.take(index), col.slice(stop, n)]
    expect = Column.concat([joined.slice(0, start), joined.slice(start, stop), joined.take(index),
                            joined.slice(stop, n)])  # fmt: skip
    for join in (False, True):
        got = Column.concat(pieces, join=join)
        # not joined unless asked to and no column among them is in parts
        assert got.in_parts == (not join or any(p.in_parts for p in pieces))
        assert got.n_rows == expect.n_rows and got.nbytes == expect.nbytes
        same(Column.concat([got.slice(0, got.n_rows // 2), got.slice(got.n_rows // 2, got.n_rows)]),
             expect.values, expect.offsets)  # fmt: skip
        same(got, expect.values, expect.offsets)
    clone = col.clone()
    assert not clone.in_parts
    same(clone, joined.values, joined.offsets)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(ALL),
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    trailing=st.lists(st.integers(0, 3), max_size=2),
    data=st.data(),
)
def test_dense_columns_joined_in_parts_are_their_concatenation(
    dtype: torch.dtype, sizes: list[int], trailing: list[int], data: st.DataObject
) -> None:
    """What a coalesced put of dense fields holds: each put's tensor a part."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1 << 16)))
    tensors = [sample(dtype, (k, *trailing), gen) for k in sizes]
    columns = [Column(FieldSchema("dense", dtype_name(dtype), tuple(trailing)), t) for t in tensors]
    got = Column.concat(columns, join=False)
    whole = torch.cat(tensors)
    assert got.in_parts == (len(columns) > 1) and got.n_rows == whole.shape[0]
    start = data.draw(st.integers(0, whole.shape[0]))
    stop = data.draw(st.integers(start, whole.shape[0]))
    index = data.draw(st.lists(st.integers(0, max(whole.shape[0] - 1, 0)), max_size=8))
    same(got.slice(start, stop), whole[start:stop], None)
    if whole.shape[0]:
        same(got.take(index), whole[index], None)
    _, frames = column_to_wire("d", got, 1, parts=True)
    buffer = frames[0]
    assert parts.nbytes(buffer) == len(bits(whole))
    assert bits(parts.joined(frames)[0]) == bits(whole)
    same(got, whole, None)


# --- per-token version bounds --------------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-3, 100), max_size=40), min_size=2, max_size=10),
    dtype=st.sampled_from(INTEGERS),
    window=st.sampled_from([1, 3, 8, 64, 1 << 20]),
    fallback=st.none() | st.integers(0, 9),
)
def test_version_bounds_of_rows_in_parts_equal_those_of_the_joined_column(
    rows: list[list[int]], dtype: torch.dtype, window: int, fallback: int | None
) -> None:
    """Read window by window (rows larger than a window on their own) from the rows as given."""
    if dtype == torch.uint8:
        rows = [[v % 256 for v in r] for r in rows]
    tensors = [torch.tensor(r, dtype=torch.int64).to(dtype) for r in rows]
    _, cols = columns_from_data({"versions": tensors})
    assert cols["versions"].in_parts
    joined = Column(cols["versions"].schema, *plain(tensors))
    saved = versions.STAGE_BYTES
    versions.STAGE_BYTES = window * dtype.itemsize
    try:
        got = row_versions("versions", cols["versions"], fallback)
    finally:
        versions.STAGE_BYTES = saved
    assert cols["versions"].in_parts  # never joined for it
    assert got == row_versions("versions", joined, fallback)


# --- what a put still refuses, and what takes the other paths ------------------------------------
@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [torch.ones(2), torch.ones(2, 2).to_sparse()],
            "field 'x': row 1: torch.sparse_coo tensors are unsupported; use .to_dense()",
        ),
        (
            [torch.ones(2), torch.ones(1, dtype=torch.int8), torch.ones(3)],
            "field 'x': ragged rows must share dtype and trailing shape; row 0 is ragged "
            "float32[*] but row 1 is ragged int8[*]; convert row 1 to ragged float32[*]",
        ),
        (
            [torch.ones(2, 3), torch.ones(2)],
            "field 'x': ragged rows must share dtype and trailing shape; row 0 is ragged "
            "float32[*,3] but row 1 is ragged float32[*]; convert row 1 to ragged float32[*,3]",
        ),
        (
            [torch.ones(2), torch.ones(3), torch.tensor(1.0)],
            "field 'x': row 2 is a 0-dim tensor; ragged rows are [L_i, ...]: use t.reshape(1)",
        ),
        (
            [torch.ones(2).to(torch.float8_e5m2)] * 2,
            "field 'x': dtype torch.float8_e5m2 is unsupported; cast to bool, uint8",
        ),
    ],
    ids=["sparse", "dtype", "trailing", "0-dim", "unsupported"],
)
def test_rows_a_put_refuses_still_name_the_row(rows: list[torch.Tensor], message: str) -> None:
    with pytest.raises(SchemaError) as info:
        columns_from_data({"x": rows})
    assert str(info.value).startswith(message)


def test_numpy_rows_and_tensor_subclasses_take_the_checked_path() -> None:
    """Rows that are not plain CPU tensors are checked one by one; numpy rows then stay in parts
    (tensors over their memory), subclasses are concatenated as before."""
    arrays = [np.arange(n, dtype=np.int32) for n in (3, 0, 2)]
    _, cols = columns_from_data({"x": arrays, "p": [torch.nn.Parameter(torch.ones(2))] * 3})
    assert cols["x"].in_parts and cols["x"].values.tolist() == [0, 1, 2, 0, 1]
    assert not cols["p"].in_parts and cols["p"].values.tolist() == [1.0] * 6
    assert not cols["p"].values.requires_grad


def test_a_column_in_parts_is_joined_once_when_its_values_are_read() -> None:
    rows = [torch.arange(3), torch.arange(2)]
    col = columns_from_data({"x": rows})[1]["x"]
    assert col.in_parts and "2 parts" in repr(col)
    first = col.values
    assert not col.in_parts and col.values is first
    joined, bounds = col.pieces()
    assert joined == [first] and bounds.tolist() == [0, 5]
    with pytest.raises(ValueError, match="object columns hold their values joined"):
        Column.from_parts(FieldSchema("object", "str"), [], np.zeros(1, np.int64), col.offsets)
