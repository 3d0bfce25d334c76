"""User data to columns: the input of a put (a TensorDict, or a mapping of field name to tensors,
numpy arrays, lists of tensors, numbers, str, bytes or JSON values, or columns already) as one
:class:`~tqstream.protocol.columns.Column` per field.

Each field's kind follows from its values: a tensor or numeric array is dense, a jagged nested
tensor or a list of tensors ragged, anything else an object field (Arrow large-binary rows); a
dense or ragged ``Column`` (e.g. packed rows as values and offsets) is checked and taken as it is.
Every error names the field and says what to pass instead.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import torch

from tqstream.errors import BatchShapeError, SchemaError
from tqstream.protocol.columns import (
    JAGGED_CLASS,
    KNOWN_DTYPES,
    WIRE_NAMES,
    Column,
    field_error,
    frombuffer,
    offsets_problem,
)
from tqstream.types import FieldSchema

__all__ = ["columns_from_data"]

_I64 = torch.int64
_STRIDED = torch.strided

# --- messages (composed where raised; each says what was expected and what to do) ---------------
_EXPECTED = (
    "expected a tensor or numpy array [n, ...] (dense), a jagged nested tensor or a list of n "
    "tensors [L_i, ...] (ragged), a tqstream Column (packed values and offsets), or a list of "
    "n str / bytes / JSON values (object)"
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


def _is(value: Any, *names: str) -> bool:
    """Whether ``value`` is one of these tensordict classes. A value can be one only once its
    module is loaded, so the check never imports tensordict (seconds, most of it torch._dynamo):
    a producer that puts tensors and lists never pays for it."""
    module = sys.modules.get("tensordict")
    if module is None:
        return False
    try:
        kinds = tuple(getattr(module, n) for n in names)
    except AttributeError:  # another thread is importing it right now: wait for the import
        import tensordict

        kinds = tuple(getattr(tensordict, n) for n in names)
    return isinstance(value, kinds)


def columns_from_data(data: Any) -> tuple[int, dict[str, Column]]:
    """Normalize a put's input (a TensorDict or a mapping of field name to values) to columns.

    Dense and ragged columns alias the input where they can (see :mod:`tqstream.protocol.columns`):
    tensors are detached, copied to CPU when they live on an accelerator (a synchronous
    device-to-host copy) and made contiguous (a copy only when they were not). Returns
    ``(n_rows, columns)``.
    """
    if _is(data, "TensorDictBase"):
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
    if isinstance(value, Column):
        return _given_column(name, value)
    if isinstance(value, torch.Tensor):
        return _tensor_column(name, value)
    if isinstance(value, (list, tuple)):
        return _list_column(name, value)
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise field_error(BatchShapeError, name, _NO_BATCH.format(what="a 0-dim numpy array"))
        if value.dtype.kind in "OUS":  # object / str / bytes arrays
            return _object_column(name, value.tolist())
        return _tensor_column(name, _from_numpy(name, value))
    if _is(value, "NonTensorStack", "NonTensorData"):
        rows = value.tolist()  # NonTensorData with batch_size [n] repeats its value n times
        if not isinstance(rows, list):
            raise field_error(
                BatchShapeError, name, _NO_BATCH.format(what="a single non-tensor value")
            )
        return _object_column(name, rows)
    if _is(value, "TensorDictBase"):
        msg = "nested TensorDicts are not supported; flatten them first (td.flatten_keys('.'))"
        raise field_error(SchemaError, name, msg)
    raise field_error(
        SchemaError, name, f"unsupported value of type {type(value).__name__}; {_EXPECTED}"
    )


def _list_column(name: str, value: Sequence[Any]) -> Column:
    """A list of tensors (ragged rows), of numbers or number lists, or of object values."""
    if value and set(map(type, value)) == _PLAIN_TENSOR:  # the common case, told apart cheaply
        return _ragged_column(name, value)
    tensors = sum(isinstance(v, (torch.Tensor, np.ndarray)) for v in value)
    if value and tensors == len(value):
        return _ragged_column(name, value)
    if tensors:
        msg = f"the list mixes {tensors} tensors with {len(value) - tensors} other values"
        raise field_error(SchemaError, name, msg + "; a ragged field needs a tensor in every row")
    numeric = _numeric_rows(value)
    if numeric is not None:
        return numeric if isinstance(numeric, Column) else _ragged_column(name, numeric)
    return _object_column(name, value)


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
        return Column(FieldSchema("dense", WIRE_NAMES[t.dtype], ()), t)
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
        raise field_error(SchemaError, name, msg + " or a numeric native-byte-order array") from exc


def _cpu(name: str, t: torch.Tensor, where: str = "") -> torch.Tensor:
    if t.layout != torch.strided:
        raise field_error(
            SchemaError, name, f"{where}{t.layout} tensors are unsupported; use .to_dense()"
        )
    if t.dtype not in WIRE_NAMES:
        raise field_error(
            SchemaError, name, f"{where}dtype {t.dtype} is unsupported; cast to {KNOWN_DTYPES}"
        )
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.dtype.is_complex:  # only complex tensors carry lazy conjugate / negative bits
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


def _tensor_column(name: str, t: Any) -> Column:  # Any: NestedTensor methods are untyped
    if type(t) is JAGGED_CLASS:
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
        raise field_error(BatchShapeError, name, _NO_BATCH.format(what="a 0-dim tensor"))
    t = _cpu(name, t)
    return Column(FieldSchema("dense", WIRE_NAMES[t.dtype], tuple(t.shape[1:])), t)


def _given_column(name: str, col: Column) -> Column:
    """A column built by the caller (e.g. packed rows: values and offsets), checked against its
    schema: what a put would have built from the same values."""
    values, offsets, schema = col.values, col.offsets, col.schema
    if schema.kind == "object":
        msg = "object columns are built from their values; pass the list of values instead"
        raise field_error(SchemaError, name, msg)
    if values.ndim == 0:
        raise field_error(BatchShapeError, name, _NO_BATCH.format(what="a 0-dim tensor"))
    values = _cpu(name, values)
    shape = tuple(values.shape[1:])
    if schema.dtype != WIRE_NAMES[values.dtype] or schema.shape != shape:
        got = FieldSchema(schema.kind, WIRE_NAMES[values.dtype], shape).describe()
        msg = f"the column's schema says {schema.describe()} but its values are {got}"
        raise field_error(SchemaError, name, msg)
    if offsets is None:
        return Column(schema, values)
    offsets = offsets.detach().to("cpu").contiguous()
    problem = offsets_problem(offsets.numpy(), values.shape[0])
    if problem is not None:
        msg = (
            f"the column's offsets must start at 0, never decrease and end at the number of "
            f"values ({values.shape[0]}): {problem}; row i is values[offsets[i]:offsets[i + 1]]"
        )
        raise field_error(SchemaError, name, msg)
    return Column(schema, values, offsets)


def _ragged_column(name: str, items: Sequence[Any]) -> Column:
    """Ragged rows from ``items``, each a tensor or a numpy array. CPU rows become a column in
    parts (each row copied once, by the writer that sends it); rows on an accelerator are
    concatenated there and moved to the CPU in one transfer."""
    if len(items) == 1:  # one trajectory per put (an agent loop's put): the row is the values
        t = _from_numpy(name, items[0]) if isinstance(items[0], np.ndarray) else items[0]
        if t.ndim and t.layout == _STRIDED:  # else the checks below say what is wrong
            values = _cpu(name, t)
            return Column(_ragged_schema(values), values, _one_row_offsets(values.shape[0]))
    plain = _plain_rows(items)
    if plain is not None:
        return _in_parts(name, items, *plain)
    rows: list[torch.Tensor] = []
    for i, item in enumerate(items):
        t = _from_numpy(name, item) if isinstance(item, np.ndarray) else item
        if t.layout != torch.strided:
            msg = f"row {i}: {t.layout} tensors are unsupported; use .to_dense()"
            raise field_error(SchemaError, name, msg, row=i)
        if t.ndim == 0:
            raise field_error(SchemaError, name, _SCALAR_ROW.format(i=i), row=i)
        if rows and (t.dtype != rows[0].dtype or t.shape[1:] != rows[0].shape[1:]):
            first, this = (_ragged_schema(r).describe() for r in (rows[0], t))
            msg = _RAGGED_MISMATCH.format(first=first, this=this, i=i)
            raise field_error(SchemaError, name, msg, row=i)
        rows.append(t)
    if len({t.device for t in rows}) > 1:
        rows = [t.cpu() for t in rows]
    plain = _plain_rows(rows)  # numpy arrays, or moved to the CPU
    if plain is not None:
        return _in_parts(name, rows, *plain)
    with torch.no_grad():  # one copy on the rows' device, then one transfer
        values = _cpu(name, torch.cat(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)  # numpy: a fraction of torch.tensor's cost
    offsets[1:] = list(itertools.accumulate(t.shape[0] for t in rows))
    return Column(_ragged_schema(values), values, torch.from_numpy(offsets))


_PLAIN_TENSOR = {torch.Tensor}


def _plain_rows(items: Sequence[Any]) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """``(dtype, trailing shape)`` of rows that are all plain strided CPU tensors of one dtype and
    one trailing shape, with at least one dimension; else None (the row-by-row checks then say
    what is wrong, or handle numpy arrays and accelerators). Two passes of attribute reads over
    the rows, and one more for their sizes (``_in_parts``): ~0.3 ms for 1024 rows, ~0.65 with
    their tensors out of cache (as in a put), where the row-by-row loop took ~1 and 1.4 ms."""
    if set(map(type, items)) != _PLAIN_TENSOR:  # not a subclass: nested, parameters, ...
        return None
    kinds = {(t.layout, t.is_cpu, t.dtype, t.ndim) for t in items}
    if len(kinds) != 1:
        return None
    ((layout, cpu, dtype, ndim),) = kinds
    if layout != _STRIDED or not cpu or not ndim:
        return None
    trailing = tuple(items[0].shape[1:])
    if ndim > 1 and len({t.shape[1:] for t in items}) != 1:
        return None
    return dtype, trailing


def _in_parts(
    name: str, rows: Sequence[torch.Tensor], dtype: torch.dtype, trailing: tuple[int, ...]
) -> Column:
    """A ragged column whose parts are ``rows`` (checked: CPU, strided, of ``dtype`` and
    ``trailing``), their offsets from the rows' sizes in one numpy pass."""
    if dtype not in WIRE_NAMES:
        raise field_error(
            SchemaError, name, f"dtype {dtype} is unsupported; cast to {KNOWN_DTYPES}"
        )
    per_row = math.prod(trailing) * dtype.itemsize
    offsets = np.zeros(len(rows) + 1, np.int64)
    if per_row:  # a tensor's nbytes is read faster than its shape
        np.cumsum([t.nbytes for t in rows], out=offsets[1:])
        offsets //= per_row
    else:
        np.cumsum([t.shape[0] for t in rows], out=offsets[1:])
    schema = FieldSchema("ragged", WIRE_NAMES[dtype], trailing)
    return Column.from_parts(schema, list(rows), offsets, torch.from_numpy(offsets))


def _one_row_offsets(length: int) -> torch.Tensor:
    return torch.from_numpy(np.array((0, length), np.int64))  # a fraction of torch.tensor's cost


def _ragged_schema(t: torch.Tensor) -> FieldSchema:
    return FieldSchema("ragged", WIRE_NAMES[t.dtype], tuple(t.shape[1:]))


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
            raise field_error(SchemaError, name, msg, row=i) from exc
    return _arrow_column("json", pa.array(encoded, type=pa.large_binary()))


def _arrow_column(kind: str, array: pa.Array) -> Column:
    """Zero copy from the Arrow buffers: each tensor references (keeps alive) its Arrow buffer."""
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = frombuffer(offsets_buffer, _I64, len(array) + 1)
    values = frombuffer(data_buffer, torch.uint8, int(offsets[-1]))
    return Column(FieldSchema("object", kind), values, offsets)
