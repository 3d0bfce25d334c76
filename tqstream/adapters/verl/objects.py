"""Exact bytes for the Python values of ``non_tensor_batch`` object arrays and ``meta_info``.

verl keeps per-row Python values in numpy object arrays (``uid``, ``raw_prompt``, ``reward_model``,
``reward_extra_info``, ``multi_modal_inputs``, ...) and compares them by value *and* type
(``verl.protocol._deep_equal``): a tuple must come back a tuple, a ``numpy.float64`` a
``numpy.float64``, a NaN a NaN. JSON cannot say any of that, and pickle would let whoever can reach
a storage unit run code in the trainer. So each value is msgpack (``msgpack`` with
``strict_types``: only exact ``dict``/``list``/``str``/``bytes``/``int``/``float``/``bool``/
``None`` are native, so subclasses never pass as their base) plus extension types for the rest:

==== ================================= =============================================================
code type                              payload
==== ================================= =============================================================
1    ``tuple``                         its items, as a list
2    numpy scalar (``np.float64``, ...) ``[dtype.str, raw bytes]``
3    numpy array (not object)          ``[dtype.str, shape, raw bytes]`` (C order)
4    numpy object array                ``[shape, items]``, each item encoded again
5    ``torch.Tensor``                  ``[dtype name, shape, raw bytes]`` (comes back on the CPU)
6    ``int`` beyond 64 bits            its decimal digits
7/8  ``set`` / ``frozenset``           its items, as a list
9    ``complex``                       ``[real, imag]``
10   ``bytearray``                     its bytes
11   ``numpy.str_``                    its UTF-8 (surrogates passed), not its array bytes: those
                                       would lose trailing NULs
12   ``numpy.bytes_``                  its bytes (likewise)
==== ================================= =============================================================

Floats are IEEE doubles, bit for bit (NaN, -0.0, infinities). Decoding builds only these types:
no class is looked up by a name from the wire, and arrays are rebuilt from raw bytes of a dtype
that holds no Python objects (anything else is a ``MalformedMessageError``). Values of any other
class (a dataclass, a PIL image, a ``dict`` subclass, ...) raise ``SchemaError`` naming the field,
the row and the type.

A column's rows are encoded one value each, back to back: a ragged ``uint8`` field (values +
offsets), which any selection of rows reads without touching the others.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from tqstream.errors import MalformedMessageError, SchemaError
from tqstream.protocol.columns import Column, dtype_name, jagged, torch_dtype
from tqstream.types import FieldSchema

__all__ = ["decode_rows", "encode_headed_rows", "encode_rows", "pack", "unpack"]

(_TUPLE, _SCALAR, _ARRAY, _OBJECTS, _TENSOR, _INT, _SET, _FROZENSET, _COMPLEX, _BYTEARRAY,
 _NP_STR, _NP_BYTES) = range(1, 13)  # fmt: skip
_SAFE = (int, float, bool, str, bytes, type(None))
_BYTES = FieldSchema("ragged", "uint8", ())


def _has_bin(data: bytes) -> bool:
    """Whether msgpack bytes may hold a bin value (its markers 0xc4-0xc6 appear; other bytes can
    hold them too, so this only rules bins out)."""
    return b"\xc4" in data or b"\xc5" in data or b"\xc6" in data


class _Unsupported(TypeError):
    """A value msgpack cannot hold exactly (raised inside ``_default``; ``value`` is it)."""

    def __init__(self, value: Any, why: str = "") -> None:
        super().__init__(why)
        self.value = value
        self.why = why


def _packb(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)


def _default(value: Any) -> msgpack.ExtType:
    """The extension type of a value msgpack has no exact native type for."""
    kind = type(value)
    if kind is tuple:
        return msgpack.ExtType(_TUPLE, _packb(list(value)))
    if kind is int:  # msgpack hands over only ints beyond 64 bits
        return msgpack.ExtType(_INT, str(value).encode())
    if kind is np.ndarray:
        return _array(value)
    if kind is np.str_:
        return msgpack.ExtType(_NP_STR, str.encode(value, "utf-8", "surrogatepass"))
    if kind is np.bytes_:
        return msgpack.ExtType(_NP_BYTES, bytes(value))
    if isinstance(value, np.generic):
        if value.dtype.hasobject or value.dtype.names is not None:
            raise _Unsupported(value, "a structured numpy scalar")
        as_array = np.asarray(value)  # np.str_("") has dtype <U0 but one item of <U1
        return msgpack.ExtType(_SCALAR, _packb([as_array.dtype.str, as_array.tobytes()]))
    if kind is torch.Tensor:
        return _tensor(value)
    if kind is set or kind is frozenset:
        return msgpack.ExtType(_SET if kind is set else _FROZENSET, _packb(list(value)))
    if kind is complex:
        return msgpack.ExtType(_COMPLEX, _packb([value.real, value.imag]))
    if kind is _ByteArray:
        return msgpack.ExtType(_BYTEARRAY, value.data)
    raise _Unsupported(value)


def _array(value: np.ndarray) -> msgpack.ExtType:
    dt = value.dtype
    if dt.hasobject:
        if dt != np.dtype(object):
            raise _Unsupported(value, "a structured numpy array holding objects")
        return msgpack.ExtType(_OBJECTS, _packb([list(value.shape), value.ravel().tolist()]))
    if dt.names is not None:
        raise _Unsupported(value, "a structured numpy array (named fields)")
    data = np.ascontiguousarray(value).tobytes()
    return msgpack.ExtType(_ARRAY, _packb([dt.str, list(value.shape), data]))


def _tensor(value: torch.Tensor) -> msgpack.ExtType:
    if value.layout != torch.strided:
        raise _Unsupported(value, f"a {value.layout} tensor (convert it with .to_dense())")
    t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return msgpack.ExtType(_TENSOR, _packb([dtype_name(t.dtype), list(t.shape), data]))


class _ByteArray:
    """A ``bytearray`` in a value (msgpack would pack it as ``bytes``): see ``_with_bytearrays``."""

    __slots__ = ("data",)

    def __init__(self, data: bytearray) -> None:
        self.data = bytes(data)


def _has_buffers(value: Any) -> bool:
    """Whether ``value`` holds a ``bytearray`` or ``memoryview``, which msgpack packs as ``bytes``
    without asking (so they must be found before packing)."""
    kind = type(value)
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        items: Any = value
    elif kind is dict:
        items = itertools.chain(value, value.values())
    elif kind is np.ndarray and value.dtype.hasobject:
        items = value.flat
    else:
        return kind is bytearray or kind is memoryview
    return any(type(v) not in _SAFE and _has_buffers(v) for v in items)


def _with_bytearrays(value: Any) -> Any:
    """A copy of ``value`` whose bytearrays are wrapped for ``_default`` (memoryviews refused)."""
    kind = type(value)
    if kind is bytearray:
        return _ByteArray(value)
    if kind is memoryview:
        raise _Unsupported(value, "a memoryview (convert it with bytes(view))")
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return kind(map(_with_bytearrays, value))
    if kind is dict:
        return {_with_bytearrays(k): _with_bytearrays(v) for k, v in value.items()}
    if kind is np.ndarray and value.dtype.hasobject:
        out = np.empty(value.size, dtype=value.dtype)
        for i, item in enumerate(value.flat):
            out[i] = _with_bytearrays(item)  # one item each: a sequence is not spread over out
        return out.reshape(value.shape)
    return value


# --- encode --------------------------------------------------------------------------------------
def _what(exc: Exception) -> str:
    if isinstance(exc, _Unsupported):
        kind = type(exc.value)
        name = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
        return exc.why or f"a {name} value {exc.value!r:.60}"
    if isinstance(exc, RecursionError) or "recursion" in str(exc):
        return "a value nested too deep, or that contains itself"
    return f"a value msgpack cannot hold ({exc})"


_ENCODE_ERRORS = (_Unsupported, ValueError, OverflowError, RecursionError)
_FIX = (
    "convert it to None, bool, int, float, complex, str, bytes, bytearray, list, tuple, set, dict, "
    "a numpy scalar or array, or a torch tensor (e.g. a dataclass with dataclasses.asdict, an "
    "image with np.asarray)"
)


def pack(value: Any, where: str) -> bytes:
    """The bytes of one value; ``where`` names it in the error (``"meta_info"``)."""
    try:
        packed = _packb(value)
        if _has_bin(packed) and _has_buffers(value):  # see encode_rows
            packed = _packb(_with_bytearrays(value))
        return packed
    except _ENCODE_ERRORS as exc:
        raise SchemaError(
            f"{where} holds {_what(exc)}, which tqstream cannot store exactly; {_FIX}",
            field=where,
        ) from exc


def _refused(name: str, row: int, exc: Exception) -> SchemaError:
    return SchemaError(
        f"non_tensor_batch[{name!r}] row {row} holds {_what(exc)}, which tqstream cannot store "
        f"exactly; {_FIX}",
        field=name,
        row=row,
    )


def _pack_value(packer: msgpack.Packer, value: Any) -> bytes:
    """One value's bytes; a bytearray or memoryview packs as bin without asking, so a value whose
    bytes may hold a bin is looked through for them (raises the ``_ENCODE_ERRORS``)."""
    packed = packer.pack(value)
    if _has_bin(packed) and type(value) is not bytes and _has_buffers(value):
        packed = packer.pack(_with_bytearrays(value))
    return packed


def _rows_column(parts: Sequence[bytes]) -> Column:
    """Row ``i`` is ``parts[i]``: a ragged ``uint8`` column."""
    values = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    ends = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), out=ends[1:])
    return Column(_BYTES, values, torch.from_numpy(ends))


def encode_rows(name: str, values: Sequence[Any]) -> torch.Tensor:
    """One encoded value per row, as a jagged ``uint8`` tensor ``[n, j]`` for the put."""
    packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    parts: list[bytes] = []
    for row, value in enumerate(values):
        try:
            parts.append(_pack_value(packer, value))
        except _ENCODE_ERRORS as exc:
            raise _refused(name, row, exc) from exc
    column = _rows_column(parts)
    assert column.offsets is not None
    return jagged(column.values, column.offsets)


def encode_headed_rows(heads: Sequence[bytes], columns: Mapping[str, Sequence[Any]]) -> Column:
    """Row ``i``: ``heads[i]`` (bytes already encoded) followed by the map ``{name: values[i]}``
    of ``columns`` (nil when there are none), as a ragged ``uint8`` column; a value that
    cannot be encoded raises ``SchemaError`` naming its column and row."""
    packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    names = list(columns)
    parts: list[bytes] = []
    for row, head in enumerate(heads):
        value = {k: columns[k][row] for k in names} if names else None
        try:
            parts.append(head + _pack_value(packer, value))
        except _ENCODE_ERRORS as exc:
            for name in names:  # which value it was
                try:
                    _pack_value(msgpack.Packer(default=_default, strict_types=True,
                                               use_bin_type=True), columns[name][row])  # fmt: skip
                except _ENCODE_ERRORS as one:
                    raise _refused(name, row, one) from one
            raise _refused(", ".join(names), row, exc) from exc
    return _rows_column(parts)


# --- decode --------------------------------------------------------------------------------------
def _unpackb(data: Any) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)


def _bad(what: str) -> MalformedMessageError:
    return MalformedMessageError(f"an encoded object value holds {what}")


def _dtype(name: Any) -> np.dtype[Any]:
    try:
        dt = np.dtype(name) if type(name) is str else None
    except TypeError:
        dt = None
    if dt is None or dt.hasobject or dt.names is not None:
        raise _bad(f"the numpy dtype {name!r}, which raw bytes cannot rebuild")
    return dt


def _from_bytes(dt: np.dtype[Any], shape: Any, data: Any) -> np.ndarray:
    if type(data) is not bytes or type(shape) is not list:
        raise _bad("a numpy array without its shape and bytes")
    if len(data) != math.prod(shape) * dt.itemsize:
        raise _bad(f"{len(data)} bytes for a {dt} array of shape {shape}")
    return np.frombuffer(data, dtype=dt).reshape(shape).copy()  # writable, as it was


def _ext(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(_unpackb(data))
    if code == _SCALAR:
        name, raw = _unpackb(data)
        return _from_bytes(_dtype(name), [], raw)[()]
    if code == _ARRAY:
        name, shape, raw = _unpackb(data)
        return _from_bytes(_dtype(name), shape, raw)
    if code == _OBJECTS:
        shape, items = _unpackb(data)
        if type(shape) is not list or type(items) is not list or len(items) != math.prod(shape):
            raise _bad("an object array whose items do not fill its shape")
        return np.fromiter(items, dtype=object, count=len(items)).reshape(shape)
    if code == _TENSOR:
        name, shape, raw = _unpackb(data)
        dtype = torch_dtype(name)
        if type(raw) is not bytes or type(shape) is not list:
            raise _bad("a tensor without its shape and bytes")
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise _bad(f"{len(raw)} bytes for a {name} tensor of shape {shape}")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if code == _INT:
        return int(data.decode("ascii"))
    if code == _SET:
        return set(_unpackb(data))
    if code == _FROZENSET:
        return frozenset(_unpackb(data))
    if code == _COMPLEX:
        real, imag = _unpackb(data)
        return complex(real, imag)
    if code == _BYTEARRAY:
        return bytearray(data)
    if code == _NP_STR:
        return np.str_(data.decode("utf-8", "surrogatepass"))
    if code == _NP_BYTES:
        return np.bytes_(data)
    raise _bad(f"the unknown extension type {code}")


_DECODE_ERRORS = (ValueError, TypeError, msgpack.UnpackException, MalformedMessageError)


def unpack(data: Any, where: str) -> Any:
    """The value of :func:`pack`'s bytes (they came from a peer: checked)."""
    try:
        return _unpackb(data)
    except _DECODE_ERRORS as exc:
        raise MalformedMessageError(f"{where} cannot be decoded ({exc})", field=where) from exc


def decode_rows(
    name: str, values: torch.Tensor, offsets: torch.Tensor, *, per_row: Literal[1, 2] = 1
) -> list[Any]:
    """The values of :func:`encode_rows`' rows (``values[offsets[i]:offsets[i + 1]]``), or with
    ``per_row=2`` each row's two values as a tuple (:func:`encode_headed_rows`: a bin head, a
    map): one streaming unpacker over the rows, each row checked to end exactly where its values
    do."""
    bounds = offsets.tolist()
    out: list[Any] = []
    if len(bounds) < 2:
        return out
    view = values.contiguous().numpy().data if values.numel() else memoryview(b"")
    first = bounds[0]
    data = view[first : bounds[-1]]
    unpacker = msgpack.Unpacker(
        ext_hook=_ext, raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1)
    )
    unpacker.feed(data)
    try:
        for end in bounds[1:]:
            if per_row == 1:
                out.append(unpacker.unpack())
            else:
                out.append((unpacker.unpack(), unpacker.unpack()))
            if unpacker.tell() != end - first:
                raise ValueError(f"the row's values end at byte {unpacker.tell()} of {end - first}")
    except _DECODE_ERRORS as exc:
        raise MalformedMessageError(
            f"field {name!r} row {len(out)} cannot be decoded ({exc})", field=name, row=len(out)
        ) from exc
    return out
