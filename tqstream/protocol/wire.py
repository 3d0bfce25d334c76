"""The wire form of columns: each column as a :class:`ColumnRef` in a message's msgpack header plus
raw frames, and back.

A column goes out as one frame per tensor (values, then offsets for ragged and object fields),
each a view of the column's tensor (no copy), or, for a small message, copied with the others into
one packed frame. The values of a column in parts (a put's list of tensors) are copied once: into
the packed frame, into the shared-memory segment that carries them (as
:class:`~tqstream.protocol.parts.Parts`), or else into a frame of their own. Received columns alias
the frames they came in. Everything here speaks only :class:`~tqstream.protocol.columns.Column`, so
clients and storage units share it; checkpoint files reuse the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tqstream.errors import MalformedMessageError
from tqstream.protocol.columns import (
    DTYPES,
    KNOWN_DTYPES,
    Column,
    dtype_name,
    frombuffer,
    offsets_problem,
)
from tqstream.protocol.messages import BufferRef, ColumnRef
from tqstream.protocol.parts import Parts

__all__ = ["column_from_wire", "column_to_wire", "columns_to_wire"]

_ALIGN = 16  # packed tensors start at multiples of this (the largest itemsize)
_NUMPY_VIEWABLE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a column's tensor for ``send(copy=False)``; the view keeps ``t`` alive.
    Column tensors are detached, on the CPU, contiguous and resolved (every column builder makes
    them so), so this is a reinterpretation, never a copy."""
    if not t.numel():  # any strides (an empty array from numpy has stride 0)
        return memoryview(b"")
    if t.dtype in _NUMPY_VIEWABLE:
        view = t.numpy().data  # a memoryview holding the array
        if view.c_contiguous:
            return view.cast("B")
    # bfloat16 & co (numpy has no such type), odd strides of size-1 dimensions
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # one value whose dimensions kept their strides: contiguous anyway
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy().data


def column_to_wire(
    name: str, col: Column, first_frame: int, parts: bool = False
) -> tuple[ColumnRef, list[Any]]:
    """The header entry and the 1 (dense) or 2 (values, offsets) frames of a column, which the
    message carries at ``first_frame`` and ``first_frame + 1``. A column in parts gives its
    values as :class:`~tqstream.protocol.parts.Parts` with ``parts`` (for a writer that copies
    them into place: a shared-memory segment), else joined into one buffer."""
    frames: list[Any]
    if col.in_parts:
        buffer = _parts(col)
        values = BufferRef(first_frame, col.schema.dtype, (col.n_values, *col.schema.shape))
        frames = [buffer if parts else buffer.join()]
    else:
        values = BufferRef(first_frame, dtype_name(col.values.dtype), tuple(col.values.shape))
        frames = [_as_bytes(col.values)]
    offsets = None
    if col.offsets is not None:
        offsets = BufferRef(first_frame + 1, "int64", tuple(col.offsets.shape))
        frames.append(_as_bytes(col.offsets))
    return ColumnRef(name, col.schema, values, offsets), frames


def _parts(col: Column) -> Parts:
    return Parts(*col.pieces(), DTYPES[col.schema.dtype], col.schema.shape)


def columns_to_wire(
    columns: Mapping[str, Column], packed: bool = False, parts: bool = False
) -> tuple[list[ColumnRef], list[Any]]:
    """Header entries and frames of several columns, frames numbered from 1 (after the header).

    ``packed``: every tensor is copied into one frame (at 16-byte aligned offsets), which costs
    less than a send and a receive per tensor for a small message (one trajectory's put); the
    values of a column in parts are copied there straight from the parts. ``parts``: the values
    of columns in parts stay :class:`~tqstream.protocol.parts.Parts` (see
    :func:`column_to_wire`)."""
    if packed:
        return _packed_to_wire(columns)
    refs: list[ColumnRef] = []
    buffers: list[Any] = []
    for name, col in columns.items():
        ref, bufs = column_to_wire(name, col, 1 + len(buffers), parts)
        refs.append(ref)
        buffers.extend(bufs)
    return refs, buffers


def _packed_to_wire(columns: Mapping[str, Column]) -> tuple[list[ColumnRef], list[Any]]:
    placed: list[tuple[memoryview | Parts, int]] = []  # each tensor's bytes, its offset there
    end = 0

    def place(b: memoryview | Parts, dtype: str, shape: tuple[int, ...]) -> BufferRef:
        nonlocal end
        placed.append((b, end))
        ref = BufferRef(1, dtype, shape, end)
        end += -(-b.nbytes // _ALIGN) * _ALIGN
        return ref

    refs = []
    for name, col in columns.items():
        if col.in_parts:
            shape = (col.n_values, *col.schema.shape)
            values = place(_parts(col), col.schema.dtype, shape)
        else:
            t = col.values
            values = place(_as_bytes(t), dtype_name(t.dtype), tuple(t.shape))
        offsets = None
        if col.offsets is not None:
            offsets = place(_as_bytes(col.offsets), "int64", tuple(col.offsets.shape))
        refs.append(ColumnRef(name, col.schema, values, offsets))
    frame = bytearray(end)
    whole = torch.frombuffer(frame, dtype=torch.uint8) if end else None
    for b, at in placed:
        if isinstance(b, Parts):
            if b.nbytes:
                assert whole is not None
                b.into(whole[at : at + b.nbytes])
        else:
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
    problem = offsets_problem(offsets.numpy(), values.shape[0])
    if problem is not None:
        raise bad(problem)
    return Column(schema, values, offsets)


def _tensor_from_frame(ref: BufferRef, frames: Sequence[Any], what: str, bad: Any) -> torch.Tensor:
    if not 1 <= ref.frame < len(frames):
        raise bad(f"{what} refer to frame {ref.frame}, but the message has frames 1.."
                  f"{len(frames) - 1} (frame 0 is the header)")  # fmt: skip
    if ref.dtype not in DTYPES:
        raise bad(f"{what} have unknown dtype {ref.dtype!r}; expected one of {KNOWN_DTYPES}")
    if ref.shape and min(ref.shape) < 0:
        raise bad(f"{what} have a negative dimension in shape {list(ref.shape)}")
    dtype, frame = DTYPES[ref.dtype], frames[ref.frame]
    expected = math.prod(ref.shape) * dtype.itemsize
    if expected == 0 and ref.offset >= 0:  # nothing to read (an empty field of a packed frame)
        if ref.offset > memoryview(getattr(frame, "buffer", frame)).nbytes:
            raise bad(f"{what} at offset {ref.offset} of frame {ref.frame} lie beyond its end")
        return torch.empty(ref.shape, dtype=dtype)
    buffer = memoryview(getattr(frame, "buffer", frame))  # zmq.Frame or any buffer
    if ref.offset >= 0:  # a part of a packed frame
        if not buffer.c_contiguous or ref.offset + expected > buffer.nbytes:
            raise bad(f"{what} at offset {ref.offset} of frame {ref.frame} need {expected} bytes "
                      f"({ref.dtype}{list(ref.shape)}), the frame has {buffer.nbytes}")  # fmt: skip
        buffer = buffer.cast("B")[ref.offset : ref.offset + expected]
    elif buffer.nbytes != expected or not buffer.c_contiguous:
        raise bad(f"{what} frame {ref.frame} has {buffer.nbytes} bytes, expected {expected} "
                  f"({ref.dtype}{list(ref.shape)})")  # fmt: skip
    t = frombuffer(buffer, dtype)
    if t.data_ptr() % dtype.itemsize:
        # copied as bytes into an aligned buffer: torch's own copy of a misaligned tensor faults
        # for some dtypes (complex128 reads 16-byte aligned), and a peer decides the alignment
        t = frombuffer(buffer, torch.uint8).clone().view(dtype)
    return t.reshape(ref.shape) if len(ref.shape) != 1 else t
