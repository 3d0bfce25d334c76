"""Columns: the one form a field's values take in memory, in storage and on the wire.

A :class:`Column` holds one field for a run of rows as at most two contiguous CPU tensors:
``values`` and, for ragged and object fields, int64 ``offsets`` (row ``i`` is
``values[offsets[i]:offsets[i + 1]]``) — or, built from a put's list of tensors, with the values
still those tensors, which the writers copy once into the frame or segment that carries them
(:meth:`Column.from_parts`, :mod:`tqstream.protocol.parts`). Object fields are Arrow large-binary
data (each row's bytes back to back), so no Python object per row lives between ``put`` and the
reader's ``to_tensordict``, and nothing is pickled: a column travels as a :class:`ColumnRef` in
the msgpack header plus one or two raw frames (:mod:`tqstream.protocol.wire`).

This module holds the column type and what it needs (the dtype tables, zero-copy tensors over
buffers, jagged nested tensors over values/offsets) and nothing about user formats, so a storage
unit imports it without the conversion code: building columns from a put's input is
:mod:`tqstream.convert.inputs`, turning them into a TensorDict :mod:`tqstream.convert.tensordict`.

Buffer lifetimes: a column never copies what it can alias. Columns built from a put alias the
caller's tensors (the caller must not mutate them until the put returns); columns received with
:func:`~tqstream.protocol.wire.column_from_wire` alias the message frames (each tensor keeps its
frame alive); slices alias their parent. All of them are therefore *read-only by contract*: writing
into one writes into a zmq frame, a storage chunk or the caller's tensor. Clone before mutating.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tqstream.errors import MalformedMessageError, SchemaError, TQStreamError
from tqstream.protocol.parts import between
from tqstream.types import FieldSchema

__all__ = [
    "DTYPES",
    "JAGGED_CLASS",
    "KNOWN_DTYPES",
    "WIRE_NAMES",
    "Column",
    "dtype_name",
    "field_error",
    "frombuffer",
    "jagged",
    "offsets_problem",
    "torch_dtype",
]

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}  # uint16+: torch>=2.3
"""The torch dtype of each wire name."""
WIRE_NAMES: dict[torch.dtype, str] = {dt: n for n, dt in DTYPES.items()}
"""The wire name of each supported torch dtype."""
KNOWN_DTYPES = ", ".join(DTYPES)
"""The wire names, listed for error messages."""
_I64 = torch.int64


def _jagged_class() -> Any:
    """The class of jagged nested tensors (``layout=torch.jagged``); None in a torch that moved
    it (then every nested tensor is encoded row by row)."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor
    except ImportError:  # pragma: no cover
        return None
    return NestedTensor


JAGGED_CLASS = _jagged_class()


def field_error(cls: type[TQStreamError], name: str, message: str, **details: Any) -> TQStreamError:
    """An error of class ``cls`` about field ``name``: ``field 'name': message``."""
    return cls(f"field {name!r}: {message}", field=name, **details)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if dtype not in WIRE_NAMES:
        raise SchemaError(
            f"unsupported dtype {dtype}; cast to one of {KNOWN_DTYPES}", dtype=str(dtype)
        )
    return WIRE_NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name; an unknown name means a malformed or foreign message."""
    if name not in DTYPES:
        raise MalformedMessageError(
            f"unknown dtype name {name!r} on the wire; expected one of {KNOWN_DTYPES} (is the peer "
            "running another tqstream or torch version?)",
            dtype=name,
        )
    return DTYPES[name]


def offsets_problem(offsets: Any, n_values: int) -> str | None:
    """What is wrong with a ragged column's offsets (a 1-D int64 numpy array, which costs a fraction
    of torch's per-call overhead on small arrays) for ``n_values`` values; None if nothing."""
    if offsets.shape[0] == 0:
        return "no offsets, expected at least 1 (rows + 1)"
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        return f"offsets must start at 0, got {first}"
    if offsets.shape[0] > 2 and bool((offsets[1:] < offsets[:-1]).any()):
        return "offsets must be nondecreasing"
    if last != n_values:
        return f"offsets end at {last} but the values have {n_values} rows"
    return None


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=_I64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _check_offsets(schema: FieldSchema, offsets: torch.Tensor | None) -> None:
    if (schema.kind == "dense") != (offsets is None):
        raise ValueError(f"{schema.kind} column: offsets must be given iff not dense")
    if offsets is not None and (offsets.dtype != _I64 or offsets.ndim != 1):
        raise ValueError("column offsets must be a 1-D int64 tensor")


class Column:
    """One field for ``n_rows`` rows; see the module docstring for layout and lifetimes.

    dense: ``values`` ``[n, *shape]``, ``offsets`` None. ragged: ``values`` ``[sum L_i, *shape]``.
    object: ``values`` uint8 (Arrow large-binary data). Ragged and object: ``offsets`` int64
    ``[n + 1]``, from 0, nondecreasing, ending at ``values.shape[0]`` (the builders of
    :mod:`tqstream.convert.inputs` and :func:`~tqstream.protocol.wire.column_from_wire` guarantee
    it; the constructor only checks the O(1) parts).

    Values in parts (:meth:`from_parts`): a dense or ragged column built from a put's list of CPU
    tensors, or joined from the columns of several puts, holds its values as those tensors
    (``parts``, back to back along the first dimension) and does not join them: the writers copy
    each part once, into the segment or frame that carries it (:mod:`tqstream.protocol.parts`).
    Reading ``values`` joins them (one copy, made once: the column keeps it). Read-only by
    contract, like every column.
    """

    __slots__ = ("_bounds", "_parts", "_values", "offsets", "schema")

    def __init__(
        self, schema: FieldSchema, values: torch.Tensor, offsets: torch.Tensor | None = None
    ) -> None:
        _check_offsets(schema, offsets)
        self.schema = schema
        self.offsets = offsets
        self._values: torch.Tensor | None = values
        self._parts: list[torch.Tensor] = []
        self._bounds: np.ndarray | None = None

    @classmethod
    def from_parts(
        cls,
        schema: FieldSchema,
        parts: list[torch.Tensor],
        bounds: np.ndarray,
        offsets: torch.Tensor | None = None,
    ) -> Column:
        """A column whose values are ``parts`` back to back: CPU tensors ``[k_i, *schema.shape]``
        of the schema's dtype (any strides), part ``i`` starting at value ``bounds[i]`` (int64
        numpy, ``len(parts) + 1`` entries, ``bounds[-1]`` the number of values). The caller
        guarantees all of it, as for ``offsets``; the parts are aliased, not copied."""
        if schema.kind == "object":
            raise ValueError("object columns hold their values joined")
        col = cls.__new__(cls)
        _check_offsets(schema, offsets)
        col.schema = schema
        col.offsets = offsets
        col._values = None
        col._parts = parts
        col._bounds = bounds
        return col

    def __repr__(self) -> str:
        values = f"{len(self._parts)} parts" if self._values is None else repr(self._values)
        return f"Column({self.schema!r}, {values}, {self.offsets!r})"

    @property
    def values(self) -> torch.Tensor:
        """The values as one tensor; a column in parts joins them here (once)."""
        values = self._values
        if values is None:  # the parts stay as they are: pieces() read meanwhile gave them
            values = self._values = self._joined()
        return values

    @property
    def in_parts(self) -> bool:
        """Whether the values are still the parts they were given as (not joined)."""
        return self._values is None

    def pieces(self) -> tuple[list[torch.Tensor], np.ndarray]:
        """The values as consecutive tensors — the parts, or the one joined tensor — and where
        each starts in the values, then their number (int64 numpy), read together."""
        values = self._values
        if values is None:
            assert self._bounds is not None
            return self._parts, self._bounds
        return [values], np.array((0, values.shape[0]), np.int64)

    @property
    def n_values(self) -> int:
        """The first dimension of ``values`` (rows for dense columns), without joining them."""
        if self._values is None:
            assert self._bounds is not None
            return int(self._bounds[-1])
        return self._values.shape[0]

    @property
    def n_rows(self) -> int:
        return self.n_values if self.offsets is None else self.offsets.shape[0] - 1

    @property
    def nbytes(self) -> int:
        values = self._values
        if values is None:
            size = self.n_values * math.prod(self.schema.shape) * DTYPES[self.schema.dtype].itemsize
        else:
            size = values.numel() * values.element_size()
        return size if self.offsets is None else size + self.offsets.numel() * 8

    def _joined(self) -> torch.Tensor:
        parts = self._parts
        if not parts:
            return torch.empty((0, *self.schema.shape), dtype=DTYPES[self.schema.dtype])
        with torch.no_grad():  # a part may require grad; columns never do
            return torch.cat(parts)

    def clone(self) -> Column:
        """The same column in memory of its own."""
        offsets = None if self.offsets is None else self.offsets.clone()
        values = self._joined() if self._values is None else self._values.clone()
        return Column(self.schema, values, offsets)

    def slice(self, start: int, stop: int) -> Column:
        """Rows ``[start, stop)``; ``values`` (or the parts) are views (zero copy), offsets are
        rebased to 0."""
        n = self.n_rows
        if not 0 <= start <= stop <= n:
            raise IndexError(f"rows [{start}, {stop}) out of range for a column of {n} rows")
        if start == 0 and stop == n:  # offsets start at 0 already
            return self
        offsets = None
        lo, hi = start, stop
        if self.offsets is not None:
            offsets = self.offsets[start : stop + 1]
            lo, hi = int(offsets[0]), int(offsets[-1])
            offsets = offsets - lo if lo else offsets
        if self._values is None:
            assert self._bounds is not None
            parts, bounds = between(self._parts, self._bounds, lo, hi)
            return Column.from_parts(self.schema, parts, bounds, offsets)
        return Column(self.schema, self._values[lo:hi], offsets)

    def take(self, index: torch.Tensor | Sequence[int]) -> Column:
        """Rows ``index`` in that order (repeats allowed), gathered with one copy of the data; a
        column in parts of one row each picks its parts instead (no copy)."""
        index = torch.as_tensor(index, dtype=_I64)
        n = self.n_rows
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"row index out of range for a column of {n} rows")
        if self._values is None and self._by_row():
            picked = index.tolist()
            parts = [self._parts[i] for i in picked]
            assert self._bounds is not None
            sizes = np.diff(self._bounds)[picked]
            bounds = np.zeros(len(picked) + 1, np.int64)
            np.cumsum(sizes, out=bounds[1:])
            offsets = None if self.offsets is None else torch.from_numpy(bounds)
            return Column.from_parts(self.schema, parts, bounds, offsets)
        if self.offsets is None:
            return Column(self.schema, _index_select(self.values, index))
        starts = self.offsets.index_select(0, index)
        lengths = self.offsets.index_select(0, index + 1) - starts
        offsets = _offsets_from_lengths(lengths)
        total = int(offsets[-1])
        # the source of every output value: its row's start + its position inside the row
        shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
        source = shift + torch.arange(total, dtype=_I64)
        return Column(self.schema, _index_select(self.values, source), offsets)

    def _by_row(self) -> bool:
        """Whether the parts are the rows, one each."""
        bounds = self._bounds
        assert bounds is not None
        if len(self._parts) != self.n_rows:
            return False
        if self.offsets is None:
            return bool((np.diff(bounds) == 1).all())
        return bool(np.array_equal(bounds, self.offsets.numpy()))

    @staticmethod
    def concat(
        columns: Sequence[Column], rows: Sequence[int] | None = None, *, join: bool = True
    ) -> Column:
        """The rows of ``columns`` in order: one copy (none for a single column). ``rows``, each
        column's row count where the caller knows it, spares reading it off every column (a tensor
        attribute read costs more than the copy of a small column). Without ``join``, or when a
        column is in parts, the values are not joined: the result is in parts (those of every
        column), which its writer copies once."""
        if not columns:
            raise ValueError("Column.concat needs at least one column")
        first = columns[0]
        if len(columns) == 1:
            return first
        for other in columns:
            if other.schema != first.schema:
                raise SchemaError(
                    f"cannot concatenate a {other.schema.describe()} column to a "
                    f"{first.schema.describe()} column: the rows of one field share one schema"
                )
        offsets = None if first.offsets is None else _joined_offsets(columns, rows)
        if join and all(c._values is not None for c in columns):
            return Column(first.schema, torch.cat([c.values for c in columns]), offsets)
        parts: list[torch.Tensor] = []
        sizes: list[int] = []
        for c in columns:
            if c._values is None:
                assert c._bounds is not None
                parts += c._parts
                sizes += np.diff(c._bounds).tolist()
            else:
                parts.append(c._values)
                sizes.append(c._values.shape[0])
        bounds = np.zeros(len(parts) + 1, np.int64)
        np.cumsum(sizes, out=bounds[1:])
        return Column.from_parts(first.schema, parts, bounds, offsets)


_SIGNED = {
    getattr(torch, f"uint{bits}"): getattr(torch, f"int{bits}")
    for bits in (16, 32, 64)
    if hasattr(torch, f"uint{bits}")
}
"""torch has no 1-D ``index_select`` for these: it gathers their bits as the signed type's."""


def _index_select(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    signed = _SIGNED.get(values.dtype)
    if signed is None:
        return values.index_select(0, index)
    return values.view(signed).index_select(0, index).view(values.dtype)


def _joined_offsets(columns: Sequence[Column], rows: Sequence[int] | None) -> torch.Tensor:
    """The offsets of ragged or object ``columns`` back to back."""
    # every column's offsets start at 0: [0, .., L0, 0, .., L1, ...], rebased in a few calls
    joined = torch.cat([c.offsets for c in columns])  # type: ignore[misc]
    if rows is None:
        rows = [c.offsets.shape[0] - 1 for c in columns]  # type: ignore[union-attr]
    if all(n == 1 for n in rows):
        ends = joined[1::2].cumsum(0)  # a row each (coalesced trajectories)
        return torch.cat([joined[:1], ends])
    sizes = torch.tensor(rows, dtype=_I64) + 1
    last = sizes.cumsum(0) - 1  # where each column's last offset sits in ``joined``
    lengths = joined[last]
    bases = lengths.cumsum(0) - lengths
    joined += torch.repeat_interleave(bases, sizes, output_size=joined.shape[0])
    keep = torch.ones(joined.shape[0], dtype=torch.bool)
    keep[last[:-1] + 1] = False  # every column's leading 0 but the first's
    return joined[keep]


_READONLY_SEEN = False
"""Whether torch has been handed a read-only buffer in this process (see ``frombuffer``)."""


def frombuffer(buffer: Any, dtype: torch.dtype, count: int = -1) -> torch.Tensor:
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
    if JAGGED_CLASS is None:  # pragma: no cover - a torch that moved the class
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return JAGGED_CLASS(values, offsets)
