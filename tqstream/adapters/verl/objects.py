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
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from tqstream.errors import MalformedMessageError, SchemaError
from tqstream.protocol.codec import dtype_name, jagged, torch_dtype

__all__ = ["decode_rows", "encode_rows", "pack", "unpack"]

_TUPLE, _SCALAR, _ARRAY, _OBJECTS, _TENSOR, _INT, _SET, _FROZENSET, _COMPLEX, _BYTEARRAY = range(
    1, 11
)
_SAFE = (int, float, bool, str, bytes, type(None))


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


def encode_rows(name: str, values: Sequence[Any]) -> torch.Tensor:
    """One encoded value per row, as a jagged ``uint8`` tensor ``[n, j]`` for the put."""
    packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    parts: list[bytes] = []
    try:
        for value in values:
            parts.append(packer.pack(value))
    except _ENCODE_ERRORS as exc:
        raise _refused(name, len(parts), exc) from exc
    joined = b"".join(parts)
    if _has_bin(joined):  # a bytearray or memoryview packs as bin without asking: find them
        for row, value in enumerate(values):
            if _has_bin(parts[row]) and type(value) is not bytes and _has_buffers(value):
                try:
                    parts[row] = packer.pack(_with_bytearrays(value))
                except _ENCODE_ERRORS as exc:
                    raise _refused(name, row, exc) from exc
        joined = b"".join(parts)
    values_t = torch.frombuffer(bytearray(joined), dtype=torch.uint8)
    offsets = torch.tensor([0, *itertools.accumulate(map(len, parts))], dtype=torch.int64)
    return jagged(values_t, offsets)


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
    raise _bad(f"the unknown extension type {code}")


_DECODE_ERRORS = (ValueError, TypeError, msgpack.UnpackException, MalformedMessageError)


def unpack(data: Any, where: str) -> Any:
    """The value of :func:`pack`'s bytes (they came from a peer: checked)."""
    try:
        return _unpackb(data)
    except _DECODE_ERRORS as exc:
        raise MalformedMessageError(f"{where} cannot be decoded ({exc})", field=where) from exc


def decode_rows(name: str, values: torch.Tensor, offsets: torch.Tensor) -> list[Any]:
    """The values of :func:`encode_rows`' rows (``values[offsets[i]:offsets[i + 1]]``)."""
    view = values.contiguous().numpy().data if values.numel() else memoryview(b"")
    out: list[Any] = []
    try:
        for lo, hi in itertools.pairwise(offsets.tolist()):
            out.append(_unpackb(view[lo:hi]))
    except _DECODE_ERRORS as exc:
        raise MalformedMessageError(
            f"field {name!r} row {len(out)} cannot be decoded ({exc})", field=name, row=len(out)
        ) from exc
    return out
