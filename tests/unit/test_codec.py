"""Columns: building them from put input, slicing/gathering, the wire form and TensorDict output."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import weakref

import msgspec
import numpy as np
import pytest
import tensordict
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tqstream.convert.inputs import columns_from_data
from tqstream.convert.tensordict import decode_objects, to_tensordict
from tqstream.errors import BatchShapeError, MalformedMessageError, SchemaError
from tqstream.protocol.columns import Column, dtype_name, torch_dtype
from tqstream.protocol.messages import BufferRef, ColumnRef
from tqstream.protocol.wire import column_from_wire, column_to_wire, columns_to_wire
from tqstream.types import FieldSchema

# tensordict >= 0.11 slices jagged nested tensors itself; older versions hand the slice to torch
TD_SLICES_JAGGED = tuple(int(x) for x in tensordict.__version__.split(".")[:2]) >= (0, 11)

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]  # fmt: skip


def sample(
    dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator | None = None
) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 50
    if dtype.is_complex:
        return torch.complex(t, -t).to(dtype)
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point:
        t = t.abs() if str(dtype).startswith("torch.uint") else t
        return t.to(torch.int64).to(dtype)
    return t.to(dtype)


def roundtrip(col: Column, name: str = "x") -> Column:
    """Through the wire with copied frames (as zmq delivers them), frame 0 being a header."""
    ref, frames = column_to_wire(name, col, 1)
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(ref), type=ColumnRef)
    return column_from_wire(ref, [b"header", *(bytes(f) for f in frames)], col.n_rows)


def rows_of(col: Column) -> list:
    if col.offsets is None:
        return list(col.values)
    o = col.offsets.tolist()
    return [col.values[o[i] : o[i + 1]] for i in range(col.n_rows)]


def same(a: Column, b: Column) -> bool:
    return (
        a.schema == b.schema
        and torch.equal(a.values, b.values)
        and ((a.offsets is None and b.offsets is None) or torch.equal(a.offsets, b.offsets))
    )


# --- dtypes and round trips ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_names_round_trip(dtype):
    assert torch_dtype(dtype_name(dtype)) is dtype
    assert dtype_name(dtype) == str(dtype).removeprefix("torch.")


def test_unknown_dtypes():
    with pytest.raises(MalformedMessageError, match=r"unknown dtype name 'float128' on the wire"):
        torch_dtype("float128")
    with pytest.raises(SchemaError, match=r"unsupported dtype torch.float8_e4m3fn; cast to one of"):
        dtype_name(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_round_trip_every_dtype(dtype):
    value = sample(dtype, (5, 3, 2))
    n, cols = columns_from_data({"x": value})
    assert n == 5 and cols["x"].schema == FieldSchema("dense", dtype_name(dtype), (3, 2))
    assert cols["x"].values.data_ptr() == value.data_ptr()  # contiguous CPU input: no copy
    ref, frames = column_to_wire("x", cols["x"], 3)
    assert len(frames) == 1 and ref.values == BufferRef(3, dtype_name(dtype), (5, 3, 2))
    assert ref.offsets is None and frames[0].nbytes == value.numel() * value.element_size()
    back = roundtrip(cols["x"])
    assert back.values.dtype == dtype and torch.equal(back.values, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_round_trip_every_dtype(dtype):
    rows = [sample(dtype, (k, 2)) for k in (3, 0, 1, 4)]
    n, cols = columns_from_data({"x": rows})
    col = cols["x"]
    assert n == 4 and col.schema == FieldSchema("ragged", dtype_name(dtype), (2,))
    assert col.offsets.tolist() == [0, 3, 3, 4, 8]
    ref, frames = column_to_wire("x", col, 1)
    assert len(frames) == 2 and ref.offsets == BufferRef(2, "int64", (5,))
    back = roundtrip(col)
    assert same(back, col)
    assert all(torch.equal(a, b) for a, b in zip(rows_of(back), rows, strict=True))


def test_ragged_trailing_dims_and_empty_rows():
    rows = [torch.zeros(0, 2, 3), torch.arange(6.0).reshape(1, 2, 3), torch.zeros(0, 2, 3)]
    _, cols = columns_from_data({"r": rows})
    assert cols["r"].schema.describe() == "ragged float32[*,2,3]"
    back = roundtrip(cols["r"])
    assert back.values.shape == (1, 2, 3) and back.offsets.tolist() == [0, 0, 1, 1]
    _, cols = columns_from_data({"r": [torch.zeros(0, dtype=torch.int32)] * 3})
    back = roundtrip(cols["r"])
    assert back.values.numel() == 0 and back.offsets.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("value", "describe", "rows"),
    [
        ([[1, 2, 3], [4, 5]], "ragged int64[*]", [[1, 2, 3], [4, 5]]),
        ([[1, 2], []], "ragged int64[*]", [[1, 2], []]),
        ([[], []], "ragged int64[*]", [[], []]),
        ([[1.5], [2]], "ragged float32[*]", [[1.5], [2.0]]),
        ([[True], [False, True]], "ragged bool[*]", [[True], [False, True]]),
        ([[[1, 2], [3, 4]], [], [[5, 6]]], "ragged int64[*,2]", [[[1, 2], [3, 4]], [], [[5, 6]]]),
        ((1, 2, 3), "dense int64[]", [1, 2, 3]),
        ([1, 2.5, True], "dense float32[]", [1.0, 2.5, 1.0]),
    ],
)
def test_python_number_lists_become_tensors(value, describe, rows):
    """Lists of numbers are what users (and verl's list_of_dict_to_tensordict) mean as tensors."""
    _, cols = columns_from_data({"x": value})
    col = roundtrip(cols["x"])
    assert col.schema.describe() == describe
    got = [t.tolist() for t in rows_of(col)] if col.offsets is not None else col.values.tolist()
    assert got == rows


@pytest.mark.parametrize(
    "value", [[["a"], ["b"]], [[1, None]], [[1], [2, [3]]], [[1], 2], [[2**70]], [1, "a"]]
)
def test_lists_that_are_not_numbers_stay_objects(value):
    _, cols = columns_from_data({"x": value})
    assert cols["x"].schema == FieldSchema("object", "json")
    assert decode_objects("x", roundtrip(cols["x"])) == value


def test_number_list_rows_of_different_trailing_shapes_are_refused():
    with pytest.raises(SchemaError, match=r"field 'x'.*row 1"):
        columns_from_data({"x": [[[1, 2]], [[1, 2, 3]]]})


def test_jagged_nested_tensor_input_is_zero_copy():
    values = torch.arange(12.0).reshape(6, 2)
    nt = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 2, 2, 6]))
    _, cols = columns_from_data({"r": nt})
    assert cols["r"].values.data_ptr() == values.data_ptr()
    assert cols["r"].offsets.tolist() == [0, 2, 2, 6]
    # offsets not starting at 0 (a view of a larger batch) are rebased, values trimmed
    nt = torch.nested.nested_tensor_from_jagged(values, torch.tensor([2, 2, 5]))
    _, cols = columns_from_data({"r": nt})
    assert cols["r"].offsets.tolist() == [0, 0, 3] and torch.equal(cols["r"].values, values[2:5])


def test_a_column_is_taken_as_it_is():
    """Packed rows (values + offsets) need no nested tensor: the put takes the column's tensors."""
    values = torch.arange(6.0).reshape(3, 2)
    col = Column(FieldSchema("ragged", "float32", (2,)), values, torch.tensor([0, 1, 1, 3]))
    n, cols = columns_from_data({"r": col, "d": torch.ones(3)})
    assert n == 3 and cols["r"].values.data_ptr() == values.data_ptr()
    back = roundtrip(cols["r"])
    assert back.offsets.tolist() == [0, 1, 1, 3] and torch.equal(back.values, values)


def test_empty_packed_values_beyond_the_frame_are_malformed():
    """An empty field of a packed frame reads nothing; its offset must still lie in the frame."""
    schema = FieldSchema("dense", "bool", (0,))
    ok = ColumnRef("m", schema, BufferRef(1, "bool", (3, 0), 16), None)
    assert column_from_wire(ok, [b"header", bytes(16)], 3).values.shape == (3, 0)
    bad = ColumnRef("m", schema, BufferRef(1, "bool", (3, 0), 17), None)
    with pytest.raises(MalformedMessageError, match="values at offset 17 of frame 1 lie beyond"):
        column_from_wire(bad, [b"header", bytes(16)], 3)


def test_empty_tensors_of_any_strides_go_on_the_wire():
    """numpy hands out empty arrays with stride 0: they are zero bytes, whatever the strides."""
    empty = torch.from_numpy(np.arange(4)[np.zeros(4, dtype=bool)])
    col = Column(FieldSchema("ragged", "int64", ()), empty, torch.tensor([0, 0]))
    assert roundtrip(col).values.numel() == 0
    _, frames = columns_to_wire({"r": col}, packed=True)
    assert len(frames) == 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_other_nested_layouts_go_row_by_row():
    strided = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(1, 3)])
    _, cols = columns_from_data({"r": strided})
    assert cols["r"].offsets.tolist() == [0, 2, 3] and cols["r"].values.shape == (3, 3)
    holed = torch.nested.narrow(
        torch.arange(12.0).reshape(3, 4), 1, torch.tensor([0, 1, 0]), torch.tensor([2, 1, 3]),
        layout=torch.jagged,
    )  # fmt: skip
    _, cols = columns_from_data({"r": holed})
    assert cols["r"].values.tolist() == [0.0, 1.0, 5.0, 8.0, 9.0, 10.0]


def test_non_contiguous_input_is_made_contiguous_and_detached():
    base = torch.arange(12.0, requires_grad=True).reshape(4, 3)
    value = base.t()  # [3, 4], not contiguous
    _, cols = columns_from_data({"x": value})
    assert cols["x"].values.is_contiguous() and not cols["x"].values.requires_grad
    assert torch.equal(roundtrip(cols["x"]).values, value.detach())
    conj = torch.tensor([[1 + 2j]]).conj()
    _, cols = columns_from_data({"c": conj})
    assert roundtrip(cols["c"]).values.item() == 1 - 2j


def test_a_one_row_ragged_field_is_made_contiguous_and_detached():
    base = torch.arange(12.0, requires_grad=True).reshape(3, 4)
    row = base.t()  # one row [4, 3], not contiguous, with a grad history
    _, cols = columns_from_data({"x": [row]})
    col = cols["x"]
    assert col.schema == FieldSchema("ragged", "float32", (3,))
    assert col.values.is_contiguous() and not col.values.requires_grad
    assert col.offsets is not None and col.offsets.tolist() == [0, 4]
    assert torch.equal(roundtrip(col).values, row.detach())
    _, cols = columns_from_data({"x": [np.arange(5, dtype=np.int32)]})  # a numpy row
    assert cols["x"].offsets.tolist() == [0, 5] and cols["x"].values.dtype == torch.int32


def test_numpy_input():
    n, cols = columns_from_data(
        {"a": np.arange(6, dtype=np.int16).reshape(3, 2), "s": np.array(["x", "yy", ""])}
    )
    assert n == 3 and cols["a"].schema == FieldSchema("dense", "int16", (2,))
    assert decode_objects("s", cols["s"]) == ["x", "yy", ""]
    _, cols = columns_from_data({"x": np.arange(6).reshape(2, 3)[:, ::-1]})  # negative strides
    assert cols["x"].values.tolist() == [[2, 1, 0], [5, 4, 3]]
    _, cols = columns_from_data({"r": [np.ones(2), np.ones(0)]})
    assert cols["r"].schema == FieldSchema("ragged", "float64", ())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_input_is_copied_to_cpu():
    _, cols = columns_from_data(
        {"x": torch.ones(2, 3, device="cuda"), "r": [torch.ones(2, device="cuda")] * 2}
    )
    assert cols["x"].values.device.type == "cpu" and cols["r"].values.device.type == "cpu"


# --- object columns ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "kind"),
    [
        (["a", "", "héllo ✓", "x" * 1000], "str"),
        ([b"", b"\x00\xff", b"abc"], "bytes"),
        ([{"a": [1, 2.5]}, None, "s", 3, True, [None, {"k": "v"}]], "json"),
        (["a", None, "b"], "json"),
        ([None, None], "json"),
        (("t", "u"), "str"),
    ],
)
def test_object_round_trip(values, kind):
    n, cols = columns_from_data({"o": values})
    col = cols["o"]
    assert n == len(values) and col.schema == FieldSchema("object", kind)
    assert col.values.dtype == torch.uint8 and col.offsets.dtype == torch.int64
    back = roundtrip(col)
    assert decode_objects("o", back) == list(values)
    assert decode_objects("o", back.slice(1, 2)) == [values[1]]
    assert decode_objects("o", back.take([1, 0, 1])) == [values[1], values[0], values[1]]


def test_object_columns_alias_arrow_buffers():
    _, cols = columns_from_data({"o": ["ab", "c"]})
    gc.collect()  # the Arrow array is gone; the tensors keep its buffers alive
    assert bytes(cols["o"].values.numpy()) == b"abc" and cols["o"].offsets.tolist() == [0, 2, 3]


def test_non_tensor_values_inside_a_tensordict():
    td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    td["s"] = NonTensorStack("a", "b", "c")
    td["same"] = "v"  # NonTensorData broadcast over the batch
    td["j"] = NonTensorStack({"k": 1}, [1], None)
    n, cols = columns_from_data(td)
    assert n == 3 and isinstance(td.get("same"), NonTensorData)
    assert decode_objects("s", cols["s"]) == ["a", "b", "c"]
    assert decode_objects("same", cols["same"]) == ["v", "v", "v"]
    assert decode_objects("j", cols["j"]) == [{"k": 1}, [1], None]


# --- input validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        ({}, BatchShapeError, "put has no fields: pass at least one field (name -> values)"),
        (
            {"a": torch.zeros(0, 2), "b": []},
            BatchShapeError,
            "empty put: 'a', 'b' has 0 rows; a put needs at least one row, skip the call when "
            "there is nothing to write",
        ),
        (
            {"a": torch.zeros(3), "b": ["x", "y"], "c": [torch.ones(1)] * 3},
            BatchShapeError,
            "fields disagree on the number of rows: 'a' has 3, 'b' has 2, 'c' has 3; every field "
            "of a put needs one entry per row (the same leading dimension)",
        ),
        (
            {"a": torch.tensor(1.0)},
            BatchShapeError,
            "field 'a': got a 0-dim tensor, but every field needs a leading batch dimension (one "
            "entry per row); pass shape [n, ...], e.g. value.unsqueeze(0) or [value] for one row",
        ),
        ({"a": np.float32(1.0)}, SchemaError, "field 'a': unsupported value of type float32"),
        ({"a": np.array(1.0)}, BatchShapeError, "field 'a': got a 0-dim numpy array, but"),
        ({"a": 5}, SchemaError, "field 'a': unsupported value of type int; expected a tensor"),
        ({"a": "text"}, SchemaError, "field 'a': unsupported value of type str; expected"),
        ({1: torch.ones(2)}, SchemaError, "field names must be str, got 1 (int)"),
        ([torch.ones(2)], SchemaError, "put data must be a TensorDict or a mapping, got list"),
        (
            {"a": [torch.ones(2), "x"]},
            SchemaError,
            "field 'a': the list mixes 1 tensors with 1 other values; a ragged field needs a "
            "tensor in every row",
        ),
        (
            {"a": [torch.ones(2, 3), torch.ones(1, 3), torch.ones(2, 3, dtype=torch.int64)]},
            SchemaError,
            "field 'a': ragged rows must share dtype and trailing shape; row 0 is ragged "
            "float32[*,3] but row 2 is ragged int64[*,3]; convert row 2 to ragged float32[*,3]",
        ),
        (
            {"a": [torch.ones(2, 3), torch.ones(2, 4)]},
            SchemaError,
            "field 'a': ragged rows must share dtype and trailing shape; row 0 is ragged "
            "float32[*,3] but row 1 is ragged float32[*,4]; convert row 1 to ragged float32[*,3]",
        ),
        (
            {"a": [torch.ones(2), torch.tensor(1.0)]},
            SchemaError,
            "field 'a': row 1 is a 0-dim tensor; ragged rows are [L_i, ...]: use t.reshape(1) "
            "for a length-1 row, or a dense [n] tensor for one scalar per row",
        ),
        # one row (the one-trajectory path) says what many rows say
        (
            {"a": [torch.tensor(1.0)]},
            SchemaError,
            "field 'a': row 0 is a 0-dim tensor; ragged rows are [L_i, ...]",
        ),
        (
            {"a": [torch.ones(2, 2).to_sparse()]},
            SchemaError,
            "field 'a': row 0: torch.sparse_coo tensors are unsupported; use .to_dense()",
        ),
        (
            {"a": [torch.ones(2).to(torch.float8_e5m2)]},
            SchemaError,
            "field 'a': dtype torch.float8_e5m2 is unsupported; cast to bool, uint8",
        ),
        (
            {"a": ["x", object()]},
            SchemaError,
            "field 'a': row 1 (object) is not JSON-serializable (Encoding objects of type object "
            "is unsupported); object fields hold all-str, all-bytes or JSON values (dict, list, "
            "str, int, float, bool, None): convert the row first",
        ),
        (
            {"a": [None, b"x"]},
            SchemaError,
            "field 'a': row 1 (bytes) is not JSON-serializable (a bytes row among other values; "
            "make every row bytes); object fields hold",
        ),
        (
            {"a": torch.ones(2, 2).to_sparse()},
            SchemaError,
            "field 'a': torch.sparse_coo tensors are unsupported; use .to_dense()",
        ),
        (
            {"a": torch.ones(2).to(torch.float8_e5m2)},
            SchemaError,
            "field 'a': dtype torch.float8_e5m2 is unsupported; cast to bool, uint8",
        ),
        ({"a": np.array(["2020-01-01"], dtype="datetime64[D]")}, SchemaError, "field 'a': cannot"),
        ({"a": np.ones(2, dtype=">f4")}, SchemaError, "field 'a': cannot convert a numpy array"),
        (
            {"a": Column(FieldSchema("ragged", "int64", ()), torch.arange(3),
                         torch.tensor([1, 3]))},
            SchemaError,
            "field 'a': the column's offsets must start at 0, never decrease and end at the "
            "number of values (3)",
        ),
        (
            {"a": Column(FieldSchema("ragged", "int64", ()), torch.arange(3),
                         torch.tensor([0, 2, 1, 3]))},
            SchemaError,
            "field 'a': the column's offsets must start at 0, never decrease",
        ),
        (
            {"a": Column(FieldSchema("dense", "float32", (2,)), torch.ones(3, 4))},
            SchemaError,
            "field 'a': the column's schema says dense float32[2] but its values are dense "
            "float32[4]",
        ),
        (
            {"a": Column(FieldSchema("dense", "float32", ()), torch.tensor(1.0))},
            BatchShapeError,
            "field 'a': got a 0-dim tensor, but every field needs a leading batch dimension",
        ),
        (
            {"a": Column(FieldSchema("object", "str", ()), torch.zeros(0, dtype=torch.uint8),
                         torch.tensor([0]))},
            SchemaError,
            "field 'a': object columns are built from their values",
        ),
    ],
)  # fmt: skip
def test_put_validation_messages(data, error, message):
    with pytest.raises(error) as info:
        columns_from_data(data)
    assert str(info.value).startswith(message), str(info.value)


def test_nested_tensordict_is_rejected():
    td = TensorDict({"a": TensorDict({"b": torch.ones(2)}, batch_size=[2])}, batch_size=[2])
    with pytest.raises(SchemaError) as info:
        columns_from_data(td)
    assert str(info.value) == (
        "field 'a': nested TensorDicts are not supported; flatten them first (td.flatten_keys('.'))"
    )


def test_error_details_name_the_field():
    with pytest.raises(SchemaError) as info:
        columns_from_data({"f": [torch.ones(1), torch.ones(1, dtype=torch.int8)]})
    assert info.value.details == {"field": "f", "row": 1}


# --- Column operations ---------------------------------------------------------------------------
def test_slice_is_zero_copy_and_rebased():
    rows = [torch.arange(k) for k in (2, 3, 0, 4)]
    _, cols = columns_from_data({"r": rows, "d": torch.ones(4, 2)})
    r = cols["r"].slice(1, 3)  # in parts: the rows put (row 2, empty, holds no value)
    assert r.in_parts and [p.data_ptr() for p in r.pieces()[0]] == [rows[1].data_ptr()]
    assert r.offsets.tolist() == [0, 3, 3] and r.n_rows == 2
    joined = roundtrip(cols["r"])  # one values tensor: a view of it
    r = joined.slice(1, 3)
    assert r.values.data_ptr() == joined.values[2:].data_ptr()
    assert r.offsets.tolist() == [0, 3, 3] and r.n_rows == 2
    assert cols["d"].slice(2, 4).values.data_ptr() == cols["d"].values[2].data_ptr()
    assert cols["r"].slice(0, 0).n_rows == 0 and cols["r"].slice(4, 4).values.numel() == 0
    with pytest.raises(IndexError, match=r"rows \[2, 5\) out of range for a column of 4 rows"):
        cols["r"].slice(2, 5)


def test_take_and_concat():
    rows = [torch.arange(k) + 10 * k for k in (2, 3, 0, 4)]
    _, cols = columns_from_data({"r": rows})
    got = cols["r"].take(torch.tensor([3, 2, 0, 3]))
    assert [t.tolist() for t in rows_of(got)] == [rows[i].tolist() for i in (3, 2, 0, 3)]
    assert cols["r"].take([]).n_rows == 0
    with pytest.raises(IndexError, match="row index out of range for a column of 4 rows"):
        cols["r"].take([4])
    joined = Column.concat([cols["r"].slice(2, 4), cols["r"].take([0]), cols["r"].slice(1, 2)])
    assert [t.tolist() for t in rows_of(joined)] == [rows[i].tolist() for i in (2, 3, 0, 1)]
    _, other = columns_from_data({"r": [torch.ones(1)]})
    with pytest.raises(SchemaError, match="cannot concatenate a ragged float32"):
        Column.concat([cols["r"], other["r"]])
    assert Column.concat([cols["r"]]) is cols["r"]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=12),
    data=st.data(),
)
def test_take_slice_match_a_row_model(lengths, data):
    rows = [torch.arange(k * 3, dtype=torch.int32).reshape(k, 3) + i for i, k in enumerate(lengths)]
    col = columns_from_data({"r": rows})[1]["r"]
    n = len(rows)
    index = data.draw(st.lists(st.integers(0, n - 1), max_size=20))
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    expect = [rows[i] for i in index] + rows[start:stop]
    got = Column.concat([col.take(index), roundtrip(col).slice(start, stop)])
    assert [t.tolist() for t in rows_of(got)] == [t.tolist() for t in expect]
    if index:  # a row each (what coalesced trajectories are): the offsets built from the lengths
        singles = Column.concat([col.slice(i, i + 1) for i in index])
        assert [t.tolist() for t in rows_of(singles)] == [rows[i].tolist() for i in index]
        assert singles.offsets is not None and singles.offsets.dtype == torch.int64
    # pieces of any size, empty ones first, last or between, with their row counts given or not
    bounds = data.draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), max_size=6))
    pieces = [col.slice(min(a, b), max(a, b)) for a, b in bounds] or [col.slice(0, 0)]
    expect = [t.tolist() for a, b in bounds for t in rows[min(a, b) : max(a, b)]]
    for counts in (None, [abs(a - b) for a, b in bounds] or [0]):
        got = Column.concat(pieces, counts)
        assert [t.tolist() for t in rows_of(got)] == expect
        assert got.offsets is not None and got.offsets.shape == (len(expect) + 1,)


# --- wire ----------------------------------------------------------------------------------------
def test_received_columns_alias_the_frames_and_keep_them_alive():
    _, cols = columns_from_data({"x": torch.arange(8).reshape(4, 2)})
    ref, frames = column_to_wire("x", cols["x"], 1)
    frame = np.frombuffer(bytes(frames[0]), dtype=np.uint8).copy()  # an owner we can weakref
    alive = weakref.ref(frame)
    col = column_from_wire(ref, [b"header", frame])
    assert col.values.data_ptr() == frame.ctypes.data
    del frame
    gc.collect()
    assert alive() is not None and col.values.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    del col
    gc.collect()
    assert alive() is None


def test_wire_buffers_keep_their_tensors_alive():
    value = torch.arange(6, dtype=torch.float16).reshape(2, 3).t()  # not contiguous: copied
    ref, frames = column_to_wire("x", Column(FieldSchema("dense", "float16", (2,)), value), 1)
    del value
    gc.collect()
    assert (
        bytes(frames[0])
        == torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.float16).numpy().tobytes()
    )
    assert column_from_wire(ref, [b"h", frames[0]]).values.tolist() == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.complex128])
@pytest.mark.parametrize("shift", [1, 4, 8])
def test_misaligned_frames_are_copied(dtype, shift):
    # torch's own clone of a complex128 tensor 8 bytes off its alignment crashes the process: the
    # copy goes through bytes
    value = (torch.arange(21, dtype=torch.float64) - 0.5).to(dtype).reshape(7, 3)
    _, cols = columns_from_data({"x": value})
    ref, frames = column_to_wire("x", cols["x"], 1)
    raw = bytearray(len(bytes(frames[0])) + 16)
    at = next(i for i in range(16) if (ctypes.addressof(ctypes.c_char.from_buffer(raw, i)) % 16)
              == shift)  # fmt: skip
    raw[at : at + len(bytes(frames[0]))] = bytes(frames[0])
    col = column_from_wire(ref, [b"h", memoryview(raw)[at : at + len(bytes(frames[0]))]])
    assert col.values.data_ptr() % dtype.itemsize == 0
    assert col.values.dtype == dtype and torch.equal(col.values, value)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_zmq_round_trip(transport):
    n, cols = columns_from_data(
        {"d": torch.randn(3, 5), "r": [torch.arange(k) for k in (1, 0, 7)], "o": ["a", "bc", ""]}
    )
    refs, frames = [], []
    for name, col in cols.items():
        ref, buffers = column_to_wire(name, col, 1 + len(frames))
        refs.append(ref)
        frames += buffers
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.PAIR) as a, ctx.socket(zmq.PAIR) as b:
        addr = "inproc://codec-test" if transport == "inproc" else "tcp://127.0.0.1"
        addr = addr if transport == "inproc" else f"{addr}:{a.bind_to_random_port(addr)}"
        if transport == "inproc":
            a.bind(addr)
        b.connect(addr)
        b.send_multipart([msgspec.msgpack.encode(refs), *frames], copy=False)
        message = a.recv_multipart(copy=False)
    refs = msgspec.msgpack.decode(message[0].bytes, type=list[ColumnRef])
    back = {ref.name: column_from_wire(ref, message, n) for ref in refs}
    assert all(same(back[name], col) for name, col in cols.items())


def ragged_wire() -> tuple[ColumnRef, list]:
    _, cols = columns_from_data({"x": [torch.ones(2, 3), torch.zeros(0, 3), torch.ones(1, 3)]})
    ref, frames = column_to_wire("x", cols["x"], 1)
    return ref, [b"header", *(bytes(f) for f in frames)]


def offsets_frame(*values: int) -> bytes:
    return torch.tensor(values, dtype=torch.int64).numpy().tobytes()


def with_values(ref: ColumnRef, **changes) -> ColumnRef:
    return msgspec.structs.replace(ref, values=msgspec.structs.replace(ref.values, **changes))


def with_offsets(ref: ColumnRef, **changes) -> ColumnRef:
    return msgspec.structs.replace(ref, offsets=msgspec.structs.replace(ref.offsets, **changes))


MALFORMED = [
    (
        lambda r, f: (msgspec.structs.replace(r, offsets=None), f),
        "a ragged column must carry offsets",
    ),
    (
        lambda r, f: (msgspec.structs.replace(r, schema=FieldSchema("dense", "float32", (3,))), f),
        "a dense column must not carry offsets",
    ),
    (
        lambda r, f: (with_values(r, dtype="float128"), f),
        "values have unknown dtype 'float128'; expected one of bool, uint8, int8",
    ),
    (
        lambda r, f: (with_values(r, frame=0), f),
        "values refer to frame 0, but the message has frames 1..2 (frame 0 is the header)",
    ),
    (lambda r, f: (with_offsets(r, frame=3), f), "offsets refer to frame 3, but the message has"),
    (
        lambda r, f: (with_values(r, shape=(4, 3)), f),
        "values frame 1 has 36 bytes, expected 48 (float32[4, 3])",
    ),
    (
        lambda r, f: (with_values(r, shape=(-3, -3)), f),
        "values have a negative dimension in shape [-3, -3]",
    ),
    (
        lambda r, f: (with_values(r, dtype="int32"), f),
        "values int32[3, 3] do not match the schema ragged float32[*,3]",
    ),
    (
        lambda r, f: (with_values(r, shape=(9,)), f),
        "values float32[9] do not match the schema ragged float32[*,3]",
    ),
    (lambda r, f: (with_offsets(r, dtype="int32"), f), "offsets must be 1-D int64, got int32[4]"),
    (
        lambda r, f: (with_offsets(r, shape=(2, 2)), f),
        "offsets must be 1-D int64, got int64[2, 2]",
    ),
    (
        lambda r, f: (with_offsets(r, shape=(0,)), [*f[:2], b""]),
        "has 0 offsets, expected at least 1 (rows + 1)",
    ),
    (lambda r, f: (r, [*f[:2], offsets_frame(1, 2, 2, 3)]), "offsets must start at 0, got 1"),
    (lambda r, f: (r, [*f[:2], offsets_frame(0, 2, 1, 3)]), "offsets must be nondecreasing"),
    (
        lambda r, f: (r, [*f[:2], offsets_frame(0, 2, 2, 2)]),
        "offsets end at 2 but the values have 3 rows",
    ),
]


@pytest.mark.parametrize(("mutate", "message"), MALFORMED)
def test_malformed_wire_refs(mutate, message):
    ref, frames = mutate(*ragged_wire())
    with pytest.raises(MalformedMessageError) as info:
        column_from_wire(ref, frames)
    assert str(info.value).startswith(f"column 'x': {message}"), str(info.value)
    assert info.value.details == {"column": "x"}


def test_malformed_row_counts_and_object_columns():
    ref, frames = ragged_wire()
    with pytest.raises(MalformedMessageError, match=r"^column 'x': has 4 offsets, expected 3 \("):
        column_from_wire(ref, frames, n_rows=2)
    _, cols = columns_from_data({"d": torch.ones(4), "o": ["a", "b", "", ""]})
    ref, buffers = column_to_wire("d", cols["d"], 1)
    with pytest.raises(MalformedMessageError, match=r"^column 'd': has 4 rows, expected 5$"):
        column_from_wire(ref, [b"h", *buffers], n_rows=5)
    ref, buffers = column_to_wire("o", cols["o"], 1)
    frames = [b"h", *(bytes(b) for b in buffers)]
    expect = "column 'o': object<{}> needs 1-D uint8 str/bytes/json data, got {}"
    for bad, got in [
        (with_values(ref, dtype="int8"), "int8[2]"),
        (msgspec.structs.replace(ref, schema=FieldSchema("object", "pickle")), "uint8[2]"),
    ]:
        with pytest.raises(MalformedMessageError) as info:
            column_from_wire(bad, frames)
        assert str(info.value) == expect.format(bad.schema.dtype, got)


@pytest.mark.parametrize(("kind", "data"), [("str", b"\xff\xfe"), ("json", b"{]")])
def test_undecodable_object_rows(kind, data):
    col = Column(FieldSchema("object", kind), torch.frombuffer(bytearray(data), dtype=torch.uint8),
                 torch.tensor([0, len(data)]))  # fmt: skip
    with pytest.raises(MalformedMessageError, match=rf"^column 'o': object<{kind}> rows cannot be"):
        decode_objects("o", roundtrip(col))


# --- TensorDict output ---------------------------------------------------------------------------
def mixed() -> tuple[int, dict[str, Column]]:
    n, cols = columns_from_data({
        "d": torch.arange(8.0).reshape(4, 2),
        "r": [torch.ones(2, 2), torch.zeros(0, 2), torch.full((3, 2), 7.0), torch.ones(1, 2)],
        "t": [torch.arange(k, dtype=torch.uint8) for k in (0, 1, 0, 2)],
        "s": ["a", "bb", "", "d"],
        "j": [{"k": [1]}, None, 3.5, "x"],
    })  # fmt: skip
    return n, {name: roundtrip(col, name) for name, col in cols.items()}


def test_to_tensordict_aliases_columns():
    n, cols = mixed()
    td = to_tensordict(n, cols)
    assert td.batch_size == (4,) and td["d"].data_ptr() == cols["d"].values.data_ptr()
    assert td["r"].is_nested and td["r"].values().data_ptr() == cols["r"].values.data_ptr()
    assert td["r"][1].shape == (0, 2) and torch.equal(td["r"][2], torch.full((3, 2), 7.0))
    assert td["s"] == ["a", "bb", "", "d"] and isinstance(td.get("s"), NonTensorStack)
    objs = td.select("s", "j")
    assert objs[1:3]["s"] == ["bb", ""] and objs[1:3]["j"] == [None, 3.5]
    assert objs[0]["j"] == {"k": [1]}
    if TD_SLICES_JAGGED:
        assert td[1:3]["r"][1].shape == (3, 2)
    else:  # tensordict < 0.11 slices each entry with torch, which refuses dim 0 of a jagged tensor
        with pytest.raises(RuntimeError, match="not supported for NestedTensor on dim=0"):
            td[1:3]
    row = td.tolist()[3]
    assert row["s"] == "d" and row["j"] == "x" and row["t"].tolist() == [0, 1]


def test_to_tensordict_padded():
    n, cols = mixed()
    td = to_tensordict(n, cols, padded=True, pad_values={"r": -1.5})
    assert td["r"].shape == (4, 3, 2) and td["r_lengths"].tolist() == [2, 0, 3, 1]
    assert td["r_lengths"].dtype == torch.int64
    assert torch.equal(td["r"][1], torch.full((3, 2), -1.5)) and td["r"][3, 0].tolist() == [1, 1]
    assert td["t"].tolist() == [[0, 0], [0, 0], [0, 0], [0, 1]] and td["t"].dtype == torch.uint8
    assert to_tensordict(n, cols, padded=True, pad_values=9)["t"][0].tolist() == [9, 9]
    with pytest.raises(SchemaError) as info:
        to_tensordict(n, cols, padded=True, pad_values={"t": -1})
    assert str(info.value) == (
        "field 't': pad value -1 does not fit its dtype uint8; pass a representable value in "
        "pad_values"
    )
    clash = {"r": cols["r"], "r_lengths": cols["d"]}
    assert set(to_tensordict(n, clash).keys()) == {"r", "r_lengths"}
    with pytest.raises(SchemaError) as info:
        to_tensordict(n, clash, padded=True)
    assert str(info.value) == (
        "field 'r': cannot pad: its lengths go under 'r_lengths', which is also a field being "
        "read; rename it or read with padded=False"
    )


def test_to_tensordict_all_empty_rows_and_zero_rows():
    _, cols = columns_from_data({"r": [torch.zeros(0, 2)] * 2})
    td = to_tensordict(2, cols, padded=True)
    assert td["r"].shape == (2, 0, 2) and td["r_lengths"].tolist() == [0, 0]
    assert to_tensordict(2, cols)["r"][1].shape == (0, 2)
    _, cols = mixed()
    empty = {name: col.slice(2, 2) for name, col in cols.items()}
    for padded in (False, True):
        td = to_tensordict(0, empty, padded=padded)
        assert td.batch_size == (0,) and td["s"] == [] and td["d"].shape == (0, 2)
    assert to_tensordict(0, empty, padded=True)["r"].shape == (0, 0, 2)
    with pytest.raises(BatchShapeError, match=r"^field 'd': has 4 rows, expected 3$"):
        to_tensordict(3, cols)


def test_read_only_frames_raise_no_warning() -> None:
    """Received frames are read-only: decoding them never shows torch's non-writable warning,
    neither for the first frame of a process nor later ones (torch warns once per process)."""
    code = """
import warnings
import torch
from tqstream.convert.inputs import columns_from_data
from tqstream.protocol.wire import column_from_wire, column_to_wire
warnings.simplefilter("error")
_, cols = columns_from_data({"x": torch.arange(6).view(3, 2)})
ref, bufs = column_to_wire("x", cols["x"], 1)
for _ in range(3):
    got = column_from_wire(ref, [b"", bytes(bufs[0])])  # bytes: read-only, like a received frame
    assert got.values.tolist() == [[0, 1], [2, 3], [4, 5]]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_ragged_batches_log_nothing_of_torch_internals() -> None:
    """torch logs a warning about its own internals at the first jagged nested tensor of a
    process; a user reading ragged fields does not see it (and later ones are built as usual)."""
    code = """
import torch
from tqstream.convert.inputs import columns_from_data
from tqstream.convert.tensordict import to_tensordict
rows = [torch.arange(n) for n in (1, 3, 2)]
for _ in range(2):
    n, cols = columns_from_data({"x": rows})
    td = to_tensordict(n, cols)
    assert [t.tolist() for t in td["x"].unbind()] == [r.tolist() for r in rows]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "is_fx_tracing" not in out.stderr, out.stderr


def test_packed_columns_round_trip_and_out_of_frame_refs_are_refused() -> None:
    _, cols = columns_from_data({"ids": [torch.arange(5)], "r": torch.tensor([1.5])})
    refs, frames = columns_to_wire(cols, packed=True)
    assert len(frames) == 1 and all(r.values.frame == 1 for r in refs)
    assert all(r.values.offset % 16 == 0 for r in refs)
    wire = [b"header", bytes(frames[0])]
    back = {r.name: column_from_wire(r, wire) for r in refs}
    assert torch.equal(back["ids"].values, torch.arange(5))
    assert torch.equal(back["r"].values, torch.tensor([1.5]))
    size = len(frames[0])
    bad = msgspec.structs.replace(refs[1], values=msgspec.structs.replace(
        refs[1].values, offset=size))  # fmt: skip
    with pytest.raises(MalformedMessageError) as err:
        column_from_wire(bad, wire)
    assert str(err.value) == (
        f"column 'r': values at offset {size} of frame 1 need 4 bytes (float32[1]), "
        f"the frame has {size}"
    )


def test_a_producer_never_loads_tensordict() -> None:
    """Starting the embedded cluster and putting tensors, lists and strings does not import
    tensordict (seconds of start-up); the first TensorDict read does, and a TensorDict put works
    as ever."""
    script = (
        "import sys, torch, tqstream\n"
        "c = tqstream.init(storage_units=1)\n"
        "c.put({'x': torch.ones(4, 2), 'y': [[1, 2], [3]] * 2, 'z': list('abcd')}, 'p')\n"
        "assert 'tensordict' not in sys.modules, 'a put imported tensordict'\n"
        "b = c.get('p', ['x', 'y', 'z'], 4, 't')\n"
        "assert b.data['x'].shape == (4, 2) and 'tensordict' in sys.modules\n"
        "from tensordict import TensorDict\n"
        "c.put(TensorDict({'x': torch.zeros(2, 2)}, batch_size=[2]), 'q')\n"
        "c.close()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_a_put_while_another_thread_imports_tensordict() -> None:
    """Puts made while another thread is in the middle of importing tensordict (a consumer's
    first TensorDict read) wait for that import instead of failing on the half-made module."""
    script = (
        "import sys, threading, torch\n"
        "from tqstream.convert.inputs import columns_from_data\n"
        "t = threading.Thread(target=lambda: __import__('tensordict'))\n"
        "t.start()\n"
        "while 'tensordict' not in sys.modules:\n"
        "    pass\n"
        "puts = 0\n"
        "while t.is_alive() or not puts:\n"
        "    columns_from_data({'x': torch.ones(2, 2), 'y': [[1], [2, 3]]})\n"
        "    puts += 1\n"
        "t.join()\n"
        "from tensordict import TensorDict\n"
        "n, cols = columns_from_data(TensorDict({'x': torch.ones(3)}, batch_size=[3]))\n"
        "assert n == 3 and list(cols) == ['x']\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
