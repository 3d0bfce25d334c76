"""Columns: the one form a field's values take in memory, in storage and on the wire.

A :class:`Column` holds one field for a run of rows as at most two contiguous CPU tensors:
``values`` and, for ragged and object fields, int64 ``offsets`` (row ``i`` is
``values[offsets[i]:offsets[i + 1]]``). Object fields are Arrow large-binary data (each row's bytes
back to back), so no Python object per row lives between ``put`` and the reader's
``to_tensordict``, and nothing is pickled: a column travels as a :class:`ColumnRef` in the msgpack
header plus one or two raw frames.

Buffer lifetimes: a column never copies what it can alias. Columns built from a put alias the
caller's tensors (the caller must not mutate them until the put returns); columns received with
:func:`column_from_wire` alias the message frames (each tensor keeps its frame alive); slices alias
their parent. All of them are therefore *read-only by contract*: writing into one writes into a zmq
frame, a storage chunk or the caller's tensor. Clone before mutating.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pyarrow as pa
import torch

from tqstream.errors import BatchShapeError, MalformedMessageError, SchemaError, TQStreamError
from tqstream.protocol.messages import BufferRef, ColumnRef
from tqstream.types import FieldSchema

if TYPE_CHECKING:  # tensordict is slow to import and storage units never need it
    from tensordict import TensorDict

__all__ = [
    "Column",
    "column_from_wire",
    "column_to_wire",
    "columns_from_data",
    "decode_objects",
    "dtype_name",
    "jagged",
    "to_tensordict",
    "torch_dtype",
]

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
_DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}  # uint16+: torch>=2.3
_NAMES: dict[torch.dtype, str] = {dt: n for n, dt in _DTYPES.items()}
_KNOWN = ", ".join(_DTYPES)
_I64 = torch.int64


def _jagged_class() -> Any:
    """The class of jagged nested tensors (``layout=torch.jagged``); None in a torch that moved
    it (then every nested tensor is encoded row by row)."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor
    except ImportError:  # pragma: no cover
        return None
    return NestedTensor


_JAGGED = _jagged_class()

# --- messages (composed where raised; each says what was expected and what to do) ---------------
_EXPECTED = (
    "expected a tensor or numpy array [n, ...] (dense), a jagged nested tensor or a list of n "
    "tensors [L_i, ...] (ragged), or a list of n str / bytes / JSON values (object)"
)
_NO_BATCH = (
    "got {what}, but every field needs a leading batch dimension (one entry per row); pass shape "
    "[n, ...], e.g. value.unsqueeze(0) or [value] for one row"
)
_SCALAR_ROW = (
    "row {i} is a 0-dim tensor; ragged rows are [L_i, ...]: use t.reshape(1) for a length-1 row, "
    "or a dense [n] tensor for one scalar per row"
)
_RAGGED_MISMATCH = (
    "ragged rows must share dtype and trailing shape; row 0 is {first} but row {i} is {this}; "
    "convert row {i} to {first}"
)
_NOT_JSON = (
    "row {i} ({type}) is not JSON-serializable ({exc}); object fields hold all-str, all-bytes or "
    "JSON values (dict, list, str, int, float, bool, None): convert the row first"
)


def _err(cls: type[TQStreamError], name: str, message: str, **details: Any) -> TQStreamError:
    return cls(f"field {name!r}: {message}", field=name, **details)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if dtype not in _NAMES:
        raise SchemaError(f"unsupported dtype {dtype}; cast to one of {_KNOWN}", dtype=str(dtype))
    return _NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name; an unknown name means a malformed or foreign message."""
    if name not in _DTYPES:
        raise MalformedMessageError(
            f"unknown dtype name {name!r} on the wire; expected one of {_KNOWN} (is the peer "
            "running another tqstream or torch version?)",
            dtype=name,
        )
    return _DTYPES[name]


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=_I64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


@dataclass(frozen=True, slots=True, eq=False)
class Column:
    """One field for ``n_rows`` rows; see the module docstring for layout and lifetimes.

    dense: ``values`` ``[n, *shape]``, ``offsets`` None. ragged: ``values`` ``[sum L_i, *shape]``.
    object: ``values`` uint8 (Arrow large-binary data). Ragged and object: ``offsets`` int64
    ``[n + 1]``, from 0, nondecreasing, ending at ``values.shape[0]`` (the builders here and
    :func:`column_from_wire` guarantee it; ``__post_init__`` only checks the O(1) parts).
    """

    schema: FieldSchema
    values: torch.Tensor
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.schema.kind == "dense") != (self.offsets is None):
            raise ValueError(f"{self.schema.kind} column: offsets must be given iff not dense")
        if self.offsets is not None and (self.offsets.dtype != _I64 or self.offsets.ndim != 1):
            raise ValueError("column offsets must be a 1-D int64 tensor")

    @property
    def n_rows(self) -> int:
        return self.values.shape[0] if self.offsets is None else self.offsets.shape[0] - 1

    @property
    def nbytes(self) -> int:
        size = self.values.numel() * self.values.element_size()
        return size if self.offsets is None else size + self.offsets.numel() * 8

    def clone(self) -> Column:
        """The same column in memory of its own."""
        offsets = None if self.offsets is None else self.offsets.clone()
        return Column(self.schema, self.values.clone(), offsets)

    def slice(self, start: int, stop: int) -> Column:
        """Rows ``[start, stop)``; ``values`` is a view (zero copy), offsets are rebased to 0."""
        n = self.n_rows
        if not 0 <= start <= stop <= n:
            raise IndexError(f"rows [{start}, {stop}) out of range for a column of {n} rows")
        if start == 0 and stop == n:  # offsets start at 0 already
            return self
        if self.offsets is None:
            return Column(self.schema, self.values[start:stop])
        offsets = self.offsets[start : stop + 1]
        lo, hi = int(offsets[0]), int(offsets[-1])
        return Column(self.schema, self.values[lo:hi], offsets - lo if lo else offsets)

    def take(self, index: torch.Tensor | Sequence[int]) -> Column:
        """Rows ``index`` in that order (repeats allowed), gathered with one copy of the data."""
        index = torch.as_tensor(index, dtype=_I64)
        n = self.n_rows
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"row index out of range for a column of {n} rows")
        if self.offsets is None:
            return Column(self.schema, self.values.index_select(0, index))
        starts = self.offsets.index_select(0, index)
        lengths = self.offsets.index_select(0, index + 1) - starts
        offsets = _offsets_from_lengths(lengths)
        total = int(offsets[-1])
        # the source of every output value: its row's start + its position inside the row
        shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
        source = shift + torch.arange(total, dtype=_I64)
        return Column(self.schema, self.values.index_select(0, source), offsets)

    @staticmethod
    def concat(columns: Sequence[Column]) -> Column:
        """The rows of ``columns`` in order: one copy (none for a single column)."""
        if not columns:
            raise ValueError("Column.concat needs at least one column")
        first = columns[0]
        if len(columns) == 1:
            return first
        for other in columns[1:]:
            if other.schema != first.schema:
                raise SchemaError(
                    f"cannot concatenate a {other.schema.describe()} column to a "
                    f"{first.schema.describe()} column: the rows of one field share one schema"
                )
        values = torch.cat([c.values for c in columns])
        if first.offsets is None:
            return Column(first.schema, values)
        parts: list[torch.Tensor] = []
        base = 0
        for c in columns:
            assert c.offsets is not None
            parts.append(c.offsets[1:] + base if parts else c.offsets)
            base += c.values.shape[0]
        return Column(first.schema, values, torch.cat(parts))


# --- put input -> columns ------------------------------------------------------------------------
def columns_from_data(data: Any) -> tuple[int, dict[str, Column]]:
    """Normalize a put's input (a TensorDict or a mapping of field name to values) to columns.

    Dense and ragged columns alias the input where they can (see the module docstring): tensors
    are detached, copied to CPU when they live on an accelerator (a synchronous device-to-host
    copy) and made contiguous (a copy only when they were not). Returns ``(n_rows, columns)``.
    """
    from tensordict import TensorDictBase

    if isinstance(data, TensorDictBase):
        items = [(key, data.get(key)) for key in data.keys()]  # noqa: SIM118 (td iter = rows)
    elif isinstance(data, Mapping):
        items = list(data.items())
    else:
        kind = type(data).__name__
        raise SchemaError(f"put data must be a TensorDict or a mapping, got {kind}", type=kind)
    if not items:
        raise BatchShapeError("put has no fields: pass at least one field (name -> values)")
    columns: dict[str, Column] = {}
    for name, value in items:
        if not isinstance(name, str):
            raise SchemaError(f"field names must be str, got {name!r} ({type(name).__name__})")
        columns[name] = _column(name, value)
    counts = {name: col.n_rows for name, col in columns.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name!r} has {n}" for name, n in counts.items())
        raise BatchShapeError(
            f"fields disagree on the number of rows: {listed}; every field of a put needs one "
            "entry per row (the same leading dimension)",
            rows=counts,
        )
    n_rows = next(iter(counts.values()))
    if n_rows == 0:
        raise BatchShapeError(
            f"empty put: {', '.join(map(repr, counts))} has 0 rows; a put needs at least one "
            "row, skip the call when there is nothing to write",
            rows=counts,
        )
    return n_rows, columns


def _column(name: str, value: Any) -> Column:
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    if isinstance(value, torch.Tensor):
        return _tensor_column(name, value)
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise _err(BatchShapeError, name, _NO_BATCH.format(what="a 0-dim numpy array"))
        if value.dtype.kind in "OUS":  # object / str / bytes arrays
            return _object_column(name, value.tolist())
        return _tensor_column(name, _from_numpy(name, value))
    if isinstance(value, (NonTensorStack, NonTensorData)):
        rows = value.tolist()  # NonTensorData with batch_size [n] repeats its value n times
        if not isinstance(rows, list):
            raise _err(BatchShapeError, name, _NO_BATCH.format(what="a single non-tensor value"))
        return _object_column(name, rows)
    if isinstance(value, TensorDictBase):
        msg = "nested TensorDicts are not supported; flatten them first (td.flatten_keys('.'))"
        raise _err(SchemaError, name, msg)
    if isinstance(value, (list, tuple)):
        tensors = sum(isinstance(v, (torch.Tensor, np.ndarray)) for v in value)
        if value and tensors == len(value):
            return _ragged_column(name, value)
        if tensors:
            msg = f"the list mixes {tensors} tensors with {len(value) - tensors} other values"
            raise _err(SchemaError, name, msg + "; a ragged field needs a tensor in every row")
        numeric = _numeric_rows(value)
        if numeric is not None:
            return numeric if isinstance(numeric, Column) else _ragged_column(name, numeric)
        return _object_column(name, value)
    raise _err(SchemaError, name, f"unsupported value of type {type(value).__name__}; {_EXPECTED}")


_NUMBER = (bool, int, float)


def _numeric_rows(value: Sequence[Any]) -> Column | list[torch.Tensor] | None:
    """A list of Python numbers as a dense column, or of number lists (``[[1, 2, 3], [4, 5]]``)
    as ragged rows, as ``torch.tensor`` would type them (int64, float32, bool; mixed rows take the
    promoted dtype; an all-empty list of lists is int64, like token ids); None if ``value`` holds
    anything else (it is then an object field)."""
    if not value:
        return None
    if all(isinstance(v, _NUMBER) for v in value):
        t = torch.tensor(value)
        return Column(FieldSchema("dense", _NAMES[t.dtype], ()), t)
    if not all(isinstance(v, (list, tuple)) for v in value):
        return None
    try:
        rows = [torch.tensor(v) if v else None for v in value]
    except (TypeError, ValueError, RuntimeError, OverflowError):  # strings, None, dicts, irregular
        return None
    full = [t for t in rows if t is not None]
    if not all(t.dtype in (torch.bool, torch.int64, torch.float32) for t in full):
        return None
    dtypes = [t.dtype for t in full]
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.int64
    trailing = full[0].shape[1:] if full else ()
    return [torch.empty((0, *trailing), dtype=dtype) if t is None else t.to(dtype) for t in rows]


def _from_numpy(name: str, array: np.ndarray) -> torch.Tensor:
    try:
        with warnings.catch_warnings():  # read-only arrays are fine: columns are read-only
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return torch.from_numpy(np.ascontiguousarray(array))  # copies only if strided
    except (TypeError, ValueError) as exc:
        msg = f"cannot convert a numpy array of dtype {array.dtype} ({exc}); pass a torch tensor"
        raise _err(SchemaError, name, msg + " or a numeric native-byte-order array") from exc


def _cpu(name: str, t: torch.Tensor, where: str = "") -> torch.Tensor:
    if t.layout != torch.strided:
        raise _err(SchemaError, name, f"{where}{t.layout} tensors are unsupported; use .to_dense()")
    if t.dtype not in _NAMES:
        raise _err(SchemaError, name, f"{where}dtype {t.dtype} is unsupported; cast to {_KNOWN}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype.is_complex:  # only complex tensors carry lazy conjugate / negative bits
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


def _tensor_column(name: str, t: Any) -> Column:  # Any: NestedTensor methods are untyped
    if type(t) is _JAGGED:
        # its buffers read as attributes: the accessors (values(), layout, lengths()) go through
        # torch's dispatch, ~100 µs per field; the dense buffers are detached by _cpu (cheap)
        plain = t._lengths is None and t._ragged_idx == 1
        if plain:
            offsets = t._offsets.detach().to("cpu", _I64)
            lo, hi = int(offsets[0]), int(offsets[-1])
            values = _cpu(name, t._values[lo:hi])
            return Column(
                _ragged_schema(values), values, (offsets - lo if lo else offsets).contiguous()
            )
    if t.is_nested:  # strided layout, holes (narrow) or ragged in another dim: row by row
        return _ragged_column(name, t.detach().unbind())
    if t.ndim == 0:
        raise _err(BatchShapeError, name, _NO_BATCH.format(what="a 0-dim tensor"))
    t = _cpu(name, t)
    return Column(FieldSchema("dense", _NAMES[t.dtype], tuple(t.shape[1:])), t)


def _ragged_column(name: str, items: Sequence[Any]) -> Column:
    rows: list[torch.Tensor] = []
    for i, item in enumerate(items):
        t = _from_numpy(name, item) if isinstance(item, np.ndarray) else item
        if t.layout != torch.strided:
            msg = f"row {i}: {t.layout} tensors are unsupported; use .to_dense()"
            raise _err(SchemaError, name, msg, row=i)
        if t.ndim == 0:
            raise _err(SchemaError, name, _SCALAR_ROW.format(i=i), row=i)
        if rows and (t.dtype != rows[0].dtype or t.shape[1:] != rows[0].shape[1:]):
            first, this = (_ragged_schema(r).describe() for r in (rows[0], t))
            msg = _RAGGED_MISMATCH.format(first=first, this=this, i=i)
            raise _err(SchemaError, name, msg, row=i)
        rows.append(t)
    if len(rows) == 1:  # one trajectory per put: the row is the values, no concatenation
        values = _cpu(name, rows[0])
    else:
        if len({t.device for t in rows}) > 1:
            rows = [t.cpu() for t in rows]
        with torch.no_grad():  # one copy on the rows' device, then (accelerators) one transfer
            values = _cpu(name, torch.cat(rows))
    ends = itertools.accumulate(t.shape[0] for t in rows)
    return Column(_ragged_schema(values), values, torch.tensor([0, *ends], dtype=_I64))


def _ragged_schema(t: torch.Tensor) -> FieldSchema:
    return FieldSchema("ragged", _NAMES[t.dtype], tuple(t.shape[1:]))


def _object_column(name: str, values: Sequence[Any]) -> Column:
    if all(isinstance(v, str) for v in values):
        return _arrow_column("str", pa.array(values, type=pa.large_string()))
    if all(isinstance(v, (bytes, bytearray)) for v in values):
        return _arrow_column("bytes", pa.array(values, type=pa.large_binary()))
    encoded = []
    for i, v in enumerate(values):
        try:
            if isinstance(v, (bytes, bytearray)):  # JSON would silently turn them into base64 str
                raise TypeError("a bytes row among other values; make every row bytes")
            if isinstance(v, (set, frozenset)):  # JSON would silently turn it into a list
                raise TypeError("JSON has no sets, it would come back a list; pass sorted(row)")
            encoded.append(msgspec.json.encode(v))
        except (TypeError, ValueError, msgspec.EncodeError) as exc:
            msg = _NOT_JSON.format(i=i, type=type(v).__name__, exc=exc)
            raise _err(SchemaError, name, msg, row=i) from exc
    return _arrow_column("json", pa.array(encoded, type=pa.large_binary()))


def _arrow_column(kind: str, array: pa.Array) -> Column:
    """Zero copy from the Arrow buffers: each tensor references (keeps alive) its Arrow buffer."""
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = _frombuffer(offsets_buffer, _I64, len(array) + 1)
    values = _frombuffer(data_buffer, torch.uint8, int(offsets[-1]))
    return Column(FieldSchema("object", kind), values, offsets)


_READONLY_SEEN = False
"""Whether torch has been handed a read-only buffer in this process (see ``_frombuffer``)."""


def _frombuffer(buffer: Any, dtype: torch.dtype, count: int = -1) -> torch.Tensor:
    """``torch.frombuffer`` (the tensor keeps ``buffer`` alive), also for zero-byte buffers.

    Read-only buffers (received frames) are expected, columns being read-only by contract, so
    torch's non-writable-buffer warning is silenced. torch emits it once per process, so only the
    first read-only buffer needs the (costly, process-wide) warning filter; this also hides the
    warning from later, unrelated ``frombuffer`` calls.
    """
    global _READONLY_SEEN
    if count == 0 or buffer is None:
        return torch.empty(0, dtype=dtype)
    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if _READONLY_SEEN or not view.readonly:
        return torch.frombuffer(buffer, dtype=dtype, count=count)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(buffer, dtype=dtype, count=count)
    _READONLY_SEEN = True
    return t


def jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor over ``values`` / ``offsets`` (zero copy), what
    ``torch.nested.nested_tensor_from_jagged`` gives, built directly: torch's function goes through
    its dispatcher to make the result an autograd view of ``values`` (~220 µs a field against
    ~55 µs), which rows read from storage never need, and logs a warning about torch's own
    internals on its first call."""
    if _JAGGED is None:  # pragma: no cover - a torch that moved the class
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return _JAGGED(values, offsets)


# --- wire ----------------------------------------------------------------------------------------
_ALIGN = 16  # packed tensors start at multiples of this (the largest itemsize)
_NUMPY_VIEWABLE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a column's tensor for ``send(copy=False)``; the view keeps ``t`` alive.
    Column tensors are detached, on the CPU, contiguous and resolved (every builder here makes
    them so), so this is a reinterpretation, never a copy."""
    if t.dtype in _NUMPY_VIEWABLE and t.numel():
        view = t.numpy().data  # a memoryview holding the array
        if view.c_contiguous:
            return view.cast("B")
    # bfloat16 & co (numpy has no such type), empty tensors, odd strides of size-1 dimensions
    return t.reshape(-1).view(torch.uint8).numpy().data


def column_to_wire(name: str, col: Column, first_frame: int) -> tuple[ColumnRef, list[memoryview]]:
    """The header entry and the 1 (dense) or 2 (values, offsets) frames of a column, which the
    message carries at ``first_frame`` and ``first_frame + 1``."""
    values = BufferRef(first_frame, dtype_name(col.values.dtype), tuple(col.values.shape))
    frames = [_as_bytes(col.values)]
    offsets = None
    if col.offsets is not None:
        offsets = BufferRef(first_frame + 1, "int64", tuple(col.offsets.shape))
        frames.append(_as_bytes(col.offsets))
    return ColumnRef(name, col.schema, values, offsets), frames


def columns_to_wire(
    columns: Mapping[str, Column], packed: bool = False
) -> tuple[list[ColumnRef], list[Any]]:
    """Header entries and frames of several columns, frames numbered from 1 (after the header).

    ``packed``: every tensor is copied into one frame (at 16-byte aligned offsets), which costs
    less than a send and a receive per tensor for a small message (one trajectory's put)."""
    if packed:
        return _packed_to_wire(columns)
    refs: list[ColumnRef] = []
    buffers: list[memoryview] = []
    for name, col in columns.items():
        ref, bufs = column_to_wire(name, col, 1 + len(buffers))
        refs.append(ref)
        buffers.extend(bufs)
    return refs, buffers


def _packed_to_wire(columns: Mapping[str, Column]) -> tuple[list[ColumnRef], list[Any]]:
    placed: list[tuple[memoryview, int]] = []  # each tensor's bytes and its offset in the frame
    end = 0

    def place(t: torch.Tensor, dtype: str) -> BufferRef:
        nonlocal end
        b = _as_bytes(t)
        placed.append((b, end))
        ref = BufferRef(1, dtype, tuple(t.shape), end)
        end += -(-b.nbytes // _ALIGN) * _ALIGN
        return ref

    refs = []
    for name, col in columns.items():
        values = place(col.values, dtype_name(col.values.dtype))
        offsets = None if col.offsets is None else place(col.offsets, "int64")
        refs.append(ColumnRef(name, col.schema, values, offsets))
    frame = bytearray(end)
    for b, at in placed:
        frame[at : at + b.nbytes] = b
    return refs, [frame]


def column_from_wire(ref: ColumnRef, frames: Sequence[Any], n_rows: int | None = None) -> Column:
    """Rebuild a column from its header entry and the message's frames (0-based, 0 = header).

    Zero copy: the tensors alias the frames (zmq ``Frame``, bytes or any buffer) and keep them
    alive, so a stored chunk pins its frames until it is released. A frame whose address is not
    aligned for the dtype (libzmq may place a frame anywhere in its receive buffer) is copied once.
    Everything a peer could get wrong raises :class:`MalformedMessageError`; so does a row count
    other than ``n_rows`` when given.
    """
    name, schema, kind = ref.name, ref.schema, ref.schema.kind

    def bad(problem: str) -> MalformedMessageError:
        return MalformedMessageError(f"column {name!r}: {problem}", column=name)

    if (kind == "dense") != (ref.offsets is None):
        raise bad(f"a {kind} column {'must not' if kind == 'dense' else 'must'} carry offsets")
    values = _tensor_from_frame(ref.values, frames, "values", bad)
    if kind == "object":
        if schema.dtype not in ("str", "bytes", "json") or (
            ref.values.dtype != "uint8" or values.ndim != 1
        ):
            got = f"{ref.values.dtype}{list(ref.values.shape)}"
            raise bad(f"object<{schema.dtype}> needs 1-D uint8 str/bytes/json data, got {got}")
    elif schema.dtype != ref.values.dtype or values.ndim < 1 or values.shape[1:] != schema.shape:
        got = f"{ref.values.dtype}{list(ref.values.shape)}"
        raise bad(f"values {got} do not match the schema {schema.describe()}")
    if ref.offsets is None:
        if n_rows is not None and values.shape[0] != n_rows:
            raise bad(f"has {values.shape[0]} rows, expected {n_rows}")
        return Column(schema, values)
    if ref.offsets.dtype != "int64" or len(ref.offsets.shape) != 1:
        raise bad(f"offsets must be 1-D int64, got {ref.offsets.dtype}{list(ref.offsets.shape)}")
    offsets = _tensor_from_frame(ref.offsets, frames, "offsets", bad)
    if offsets.shape[0] < 1 or (n_rows is not None and offsets.shape[0] != n_rows + 1):
        expected = "at least 1" if n_rows is None else str(n_rows + 1)
        raise bad(f"has {offsets.shape[0]} offsets, expected {expected} (rows + 1)")
    checked = offsets.numpy()  # numpy: a fraction of torch's per-call cost on small arrays
    first, last = int(checked[0]), int(checked[-1])
    if first != 0:
        raise bad(f"offsets must start at 0, got {first}")
    if checked.shape[0] > 2 and bool((checked[1:] < checked[:-1]).any()):
        raise bad("offsets must be nondecreasing")
    if last != values.shape[0]:
        raise bad(f"offsets end at {last} but the values have {values.shape[0]} rows")
    return Column(schema, values, offsets)


def _tensor_from_frame(ref: BufferRef, frames: Sequence[Any], what: str, bad: Any) -> torch.Tensor:
    if not 1 <= ref.frame < len(frames):
        raise bad(f"{what} refer to frame {ref.frame}, but the message has frames 1.."
                  f"{len(frames) - 1} (frame 0 is the header)")  # fmt: skip
    if ref.dtype not in _DTYPES:
        raise bad(f"{what} have unknown dtype {ref.dtype!r}; expected one of {_KNOWN}")
    if any(d < 0 for d in ref.shape):
        raise bad(f"{what} have a negative dimension in shape {list(ref.shape)}")
    dtype, frame = _DTYPES[ref.dtype], frames[ref.frame]
    buffer = memoryview(getattr(frame, "buffer", frame))  # zmq.Frame or any buffer
    expected = math.prod(ref.shape) * dtype.itemsize
    if ref.offset >= 0:  # a part of a packed frame
        if not buffer.c_contiguous or ref.offset + expected > buffer.nbytes:
            raise bad(f"{what} at offset {ref.offset} of frame {ref.frame} need {expected} bytes "
                      f"({ref.dtype}{list(ref.shape)}), the frame has {buffer.nbytes}")  # fmt: skip
        buffer = buffer.cast("B")[ref.offset : ref.offset + expected]
    elif buffer.nbytes != expected or not buffer.c_contiguous:
        raise bad(f"{what} frame {ref.frame} has {buffer.nbytes} bytes, expected {expected} "
                  f"({ref.dtype}{list(ref.shape)})")  # fmt: skip
    t = _frombuffer(buffer, dtype)
    if t.data_ptr() % dtype.itemsize:
        # copied as bytes into an aligned buffer: torch's own copy of a misaligned tensor faults
        # for some dtypes (complex128 reads 16-byte aligned), and a peer decides the alignment
        t = _frombuffer(buffer, torch.uint8).clone().view(dtype)
    return t.reshape(ref.shape) if len(ref.shape) != 1 else t


# --- columns -> TensorDict -----------------------------------------------------------------------
def to_tensordict(
    n_rows: int,
    columns: Mapping[str, Column],
    *,
    padded: bool = False,
    pad_values: float | Mapping[str, float] = 0,
) -> TensorDict:
    """A TensorDict ``[n_rows]`` of the columns, aliasing their tensors where the layout allows.

    dense: the values tensor. ragged: a jagged nested tensor over values/offsets (zero copy), or
    with ``padded`` a dense ``[n, max_len, *shape]`` copy filled with the field's pad value plus
    its int64 lengths ``[n]`` under ``"<name>_lengths"``. object: a ``NonTensorStack`` of the
    decoded values (``td[name]`` is then a list, ``td.get(name)`` the stack).
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    out: dict[str, Any] = {}
    for name, col in columns.items():
        if col.n_rows != n_rows:
            raise _err(BatchShapeError, name, f"has {col.n_rows} rows, expected {n_rows}")
        if col.offsets is None:
            out[name] = col.values
        elif col.schema.kind == "object":
            values = decode_objects(name, col)
            # tensordict < 0.11 cannot build an empty NonTensorStack (it reads its first row)
            out[name] = NonTensorStack(*values) if values else NonTensorData([], batch_size=[0])
        elif not padded:
            out[name] = jagged(col.values, col.offsets)
        else:
            key = f"{name}_lengths"
            if key in columns:
                msg = f"cannot pad: its lengths go under {key!r}, which is also a field being read"
                raise _err(SchemaError, name, msg + "; rename it or read with padded=False")
            pad = pad_values.get(name, 0) if isinstance(pad_values, Mapping) else pad_values
            out[name], out[key] = _pad(name, col, pad)
    return TensorDict(out, batch_size=[n_rows])


def _pad(name: str, col: Column, pad: float) -> tuple[torch.Tensor, torch.Tensor]:
    assert col.offsets is not None
    values, offsets, n = col.values, col.offsets, col.n_rows
    exact = values.dtype.is_floating_point or values.dtype.is_complex
    if not exact and torch.tensor(pad).to(values.dtype).item() != pad:  # e.g. -1 for uint8
        msg = f"pad value {pad!r} does not fit its dtype {_NAMES[values.dtype]}"
        raise _err(SchemaError, name, msg + "; pass a representable value in pad_values")
    lengths = offsets[1:] - offsets[:-1]
    out = torch.full(
        (n, int(lengths.max()) if n else 0, *values.shape[1:]), pad, dtype=values.dtype
    )
    total = values.shape[0]
    rows = torch.repeat_interleave(torch.arange(n, dtype=_I64), lengths, output_size=total)
    out[rows, torch.arange(total, dtype=_I64) - offsets.index_select(0, rows)] = values
    return out, lengths


def decode_objects(name: str, col: Column) -> list[Any]:
    """The Python values of an object column (str, bytes, or decoded JSON) in row order.

    JSON rows come back as JSON types: tuples as lists, dict keys as str, NaN as None, bytes nested
    in a value as base64 str. The bytes came from a peer, so they are validated (UTF-8 too).
    """
    assert col.offsets is not None
    n, kind = col.n_rows, col.schema.dtype
    if n == 0:
        return []
    data = col.values.contiguous().numpy()
    try:
        if kind in ("str", "bytes"):
            arrow_type = pa.large_string() if kind == "str" else pa.large_binary()
            buffers = [None, pa.py_buffer(col.offsets.contiguous().numpy()), pa.py_buffer(data)]
            array = pa.Array.from_buffers(arrow_type, n, buffers)
            array.validate(full=True)
            return array.to_pylist()
        view, offsets, decode = data.data, col.offsets.tolist(), msgspec.json.decode
        return [decode(view[offsets[i] : offsets[i + 1]]) for i in range(n)]
    except (pa.ArrowInvalid, UnicodeDecodeError, msgspec.DecodeError) as exc:
        msg = f"column {name!r}: object<{kind}> rows cannot be decoded ({exc})"
        raise MalformedMessageError(msg, column=name) from exc
