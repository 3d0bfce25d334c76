"""Arrays between tqstream's columns and JAX: dtypes, zero-copy views, buckets, padding, packing.

Copies, on the CPU (every count is of the tensor bytes; the controller's metadata aside):

- a dense field: none when its rows lie at a 64-byte aligned address of the storage unit's
  shared segment (XLA's CPU client aliases such a buffer through DLPack), else one (XLA copies an
  unaligned buffer when it takes it);
- a ragged field, padded or packed: one, from the segment into a 64-byte aligned buffer of the
  padded shape that the ``jax.Array`` then aliases (the pad itself is written once, a ``memset``;
  a zero pad is ``calloc``'s, for a large buffer the fresh pages the kernel zeroed: no pass);
- under JAX's default 32-bit mode an int64/uint64 field is checked (one read) and narrowed in
  that same copy (a dense one is copied once, narrowed).

Everything here is pure: no client, no sockets (the iterator and the writer own those).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
import torch

from tqstream.convert import padding
from tqstream.errors import BucketError, SchemaError
from tqstream.protocol.columns import DTYPES, Column

__all__ = [
    "NP_DTYPES", "Buckets", "bucket_for", "check_buckets", "jax_dtype", "numpy_view", "pack",
    "pad_rows", "to_jax", "torch_view",
]  # fmt: skip

NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name) for name in DTYPES
}
"""The numpy dtype of each tqstream dtype (``bfloat16``: ml_dtypes', the one JAX uses)."""
_WIRE_OF_NP = {dt: name for name, dt in NP_DTYPES.items()}
SUPPORTED = ", ".join(NP_DTYPES)
_NARROW = {"int64": "int32", "uint64": "uint32"}
_WIDE = ("float64", "complex128")
X64_FLAG = 'jax.config.update("jax_enable_x64", True)'

Buckets = Mapping[str, Sequence[int]]


def x64() -> bool:
    """Whether JAX has 64-bit types now (``jax_enable_x64``)."""
    return bool(jax.config.read("jax_enable_x64"))


def wire_name(dtype: Any, name: str) -> str:
    """The tqstream dtype of a numpy/JAX dtype; a dtype tqstream lacks (float8, int4, ...) is a
    ``SchemaError`` naming the supported ones."""
    found = _WIRE_OF_NP.get(np.dtype(dtype))
    if found is None:
        raise SchemaError(
            f"field {name!r}: dtype {np.dtype(dtype)} has no tqstream counterpart; cast it to one "
            f"of {SUPPORTED}",
            field=name,
            dtype=str(dtype),
        )
    return found


def jax_dtype(name: str, dtype: str) -> str:
    """The dtype field ``name`` (tqstream dtype ``dtype``) takes in JAX as configured now.

    With ``jax_enable_x64`` off JAX has no 64-bit types: int64/uint64 become int32/uint32 (after
    :func:`check_fits`: a value that does not fit is an error, never wrapped), and float64 /
    complex128 are refused rather than rounded."""
    if x64() or (dtype not in _NARROW and dtype not in _WIDE):
        return dtype
    if dtype in _WIDE:
        raise SchemaError(
            f"field {name!r} is {dtype}, which JAX's default 32-bit mode does not have (it would "
            f"round it to {'float32' if dtype == 'float64' else 'complex64'}); enable 64-bit types "
            f"with {X64_FLAG} before reading, or store the field as "
            f"{'float32' if dtype == 'float64' else 'complex64'}",
            field=name,
            dtype=dtype,
        )
    return _NARROW[dtype]


def check_fits(name: str, values: np.ndarray, target: str) -> None:
    """Every value of ``values`` is representable in ``target`` (one pass), else a
    ``SchemaError`` naming the first value out of range and ``jax_enable_x64``."""
    if values.size == 0:
        return
    info = np.iinfo(NP_DTYPES[target])
    low, high = values.min(), values.max()
    if low >= info.min and high <= info.max:
        return
    bad = int(low) if low < info.min else int(high)
    raise SchemaError(
        f"field {name!r} holds {bad}, which does not fit {target}: JAX's default 32-bit mode "
        f"would wrap it; enable 64-bit types with {X64_FLAG} before reading",
        field=name,
        value=bad,
    )


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The numpy array over a CPU tensor's memory (zero copy; bfloat16 as ml_dtypes')."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def torch_view(a: np.ndarray) -> torch.Tensor:
    """The torch tensor over a numpy array's memory (zero copy; a read-only array, e.g. a JAX
    array's host view, stays read-only by contract: tqstream never writes into a put's input)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch_view(a.view(np.uint16)).view(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def aligned_empty(
    shape: Sequence[int], dtype: str, *, zeroed: bool = False
) -> tuple[torch.Tensor, np.ndarray]:
    """:func:`tqstream.convert.padding.aligned_empty` of a tqstream dtype, as a tensor (for
    DLPack) and a numpy view of it (for the copies; the tensor keeps it, and so the memory,
    alive)."""
    out = padding.aligned_empty(shape, NP_DTYPES[dtype], zeroed=zeroed)
    return torch_view(out), out


def to_jax(t: torch.Tensor) -> jax.Array:
    """A ``jax.Array`` over a contiguous CPU tensor through DLPack (the array keeps the tensor,
    and so the memory it views, alive). The caller narrowed 64-bit values first: DLPack itself
    would wrap them in 32-bit mode."""
    return jax.dlpack.from_dlpack(t.contiguous())


def dense(name: str, col: Column) -> jax.Array:
    """A dense column as a ``jax.Array``: aliased if aligned, narrowed after a check if needed."""
    target = jax_dtype(name, col.schema.dtype)
    if target == col.schema.dtype:
        return to_jax(col.values)
    src = numpy_view(col.values)
    check_fits(name, src, target)
    t, out = aligned_empty(src.shape, target)
    out[...] = src
    return to_jax(t)


def check_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` as an increasing tuple of positive ints, else a ``BucketError``."""
    values = tuple(buckets)
    if not values:
        raise BucketError(
            f"field {name!r}: buckets are empty; give the lengths a ragged field may be padded "
            f"to, increasing, e.g. (128, 256, 512)",
            field=name,
        )
    for b in values:
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b <= 0:
            raise BucketError(
                f"field {name!r}: bucket {b!r} is not a positive int (buckets: {values})",
                field=name,
            )
    if any(b >= c for b, c in itertools.pairwise(values)):
        raise BucketError(
            f"field {name!r}: buckets must be strictly increasing, got {values}", field=name
        )
    return tuple(int(b) for b in values)


def bucket_for(name: str, longest: int, buckets: tuple[int, ...] | None) -> int:
    """The smallest bucket that holds ``longest`` (no buckets: ``longest``), else a
    ``BucketError`` naming both."""
    if buckets is None:
        return longest
    for b in buckets:
        if longest <= b:
            return b
    raise BucketError(
        f"field {name!r}: a row of {longest} is longer than the largest bucket "
        f"(buckets: {buckets}); add a larger bucket, or cap the rollout's length at {buckets[-1]}",
        field=name,
        length=longest,
        buckets=list(buckets),
    )


def pad_value(name: str, pad: float, dtype: str) -> Any:
    """``pad`` in ``dtype``, checked to be representable (e.g. -1 is not a uint8)."""
    np_dtype = NP_DTYPES[dtype]
    if np.issubdtype(np_dtype, np.integer) or np_dtype == np.bool_:
        if np_dtype == np.bool_:
            ok = pad in (0, 1)
        else:
            info = np.iinfo(np_dtype)
            ok = float(pad).is_integer() and info.min <= pad <= info.max
        if not ok:
            raise SchemaError(
                f"field {name!r}: pad value {pad!r} does not fit its dtype {dtype}; pass a "
                f"representable value in pad_values",
                field=name,
            )
        return np_dtype.type(int(pad))
    return np_dtype.type(pad)


def lengths_of(col: Column) -> np.ndarray:
    assert col.offsets is not None
    off = col.offsets.numpy()
    return (off[1:] - off[:-1]).astype(np.int32)


def pad_rows(name: str, col: Column, length: int, pad: float) -> jax.Array:
    """A ragged column ``[sum L_i, *shape]`` as ``[n, length, *shape]``: rows first, then the pad
    value (one copy of each row into an aligned buffer the ``jax.Array`` aliases)."""
    assert col.offsets is not None
    target = jax_dtype(name, col.schema.dtype)
    src = numpy_view(col.values)
    if target != col.schema.dtype:
        check_fits(name, src, target)
    off = col.offsets.numpy()
    n, trail = off.shape[0] - 1, tuple(col.values.shape[1:])
    fill = pad_value(name, pad, target)  # checked even when no row needs it: fails early
    full = bool(n) and src.shape[0] == n * length  # every row already of the bucket's length
    zero = not full and not fill.tobytes().strip(b"\0")  # 0, 0.0, False: calloc's pages are it
    t, out = aligned_empty((n, length, *trail), target, zeroed=zero)
    if not full and not zero:
        out.fill(fill)
    padding.copy_rows(out, src, off)
    return to_jax(t)


def pack(name: str, col: Column, length: int, pad: float) -> tuple[jax.Array, jax.Array]:
    """A ragged column's values padded to ``length`` tokens, and their segment ids: row ``i``'s
    tokens have id ``i + 1``, the padding 0 (the convention of packed attention masks)."""
    assert col.offsets is not None
    target = jax_dtype(name, col.schema.dtype)
    src = numpy_view(col.values)
    if target != col.schema.dtype:
        check_fits(name, src, target)
    total, trail = src.shape[0], tuple(col.values.shape[1:])
    t, out = aligned_empty((length, *trail), target)
    out[:total] = src
    out[total:] = pad_value(name, pad, target)
    seg_t, seg = aligned_empty((length,), "int32")
    lengths = lengths_of(col)
    seg[:total] = np.repeat(np.arange(1, lengths.shape[0] + 1, dtype=np.int32), lengths)
    seg[total:] = 0
    return to_jax(t), to_jax(seg_t)
