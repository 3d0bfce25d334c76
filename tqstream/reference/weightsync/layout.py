"""Where each weight lies in a sync's byte stream: pure arithmetic, no I/O.

A sync moves one *byte stream*: every tensor of the state dict, in the order of the metadata list,
each starting at a multiple of :data:`ALIGN` (so received tensors are aligned views). The stream
travels as ranges (:func:`plan`): a large tensor is broadcast straight from its own memory, small
ones are packed into buckets. The sender announces the ranges before it sends them, so a receiver
can always take part in every broadcast — and so never leaves the sender hanging — even when the
weights it expects turn out to differ; it then raises
:class:`~tqstream.errors.WeightMismatchError` instead of loading them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence

import msgspec
import torch

from tqstream.errors import WeightMismatchError

ALIGN = 16
"""Every tensor starts at a multiple of this many bytes of the stream (the largest itemsize)."""

_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WeightMismatchError(f"weights of dtype {dtype} cannot be synced; cast them to one of "
                                  f"{sorted(_DTYPES)}", dtype=name)  # fmt: skip
    return name


@dataclasses.dataclass(frozen=True)
class WeightMeta:
    """Names, dtypes and shapes of the weights, in sync order (vLLM's ``WeightUpdateRequest``
    fields), and where each lies in the byte stream."""

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise WeightMismatchError(
                f"weight metadata lists {n} names, {len(self.dtype_names)} dtypes and "
                f"{len(self.shapes)} shapes; they must be as many"
            )
        if len(set(self.names)) != n:
            raise WeightMismatchError("weight metadata names a weight twice")
        for name, dt in zip(self.names, self.dtype_names, strict=True):
            if dt not in _DTYPES:
                raise WeightMismatchError(f"weight {name!r} has unknown dtype {dt!r}", name=name)

    @classmethod
    def of(cls, weights: Mapping[str, torch.Tensor]) -> WeightMeta:
        return cls(
            tuple(weights),
            tuple(dtype_name(t.dtype) for t in weights.values()),
            tuple(tuple(t.shape) for t in weights.values()),
        )

    @classmethod
    def decode(cls, data: bytes) -> WeightMeta:
        names, dtypes, shapes = msgspec.msgpack.decode(data)
        return cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes))

    def encode(self) -> bytes:
        return msgspec.msgpack.encode([self.names, self.dtype_names, self.shapes])

    @property
    def fingerprint(self) -> int:
        """A 63-bit digest of the metadata: equal metadata, equal fingerprint."""
        digest = hashlib.blake2b(self.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * _DTYPES[self.dtype_names[i]].itemsize

    @property
    def offsets(self) -> list[int]:
        """Each tensor's first byte in the stream."""
        out, at = [], 0
        for i in range(len(self.names)):
            out.append(at)
            at += -(-self.nbytes(i) // ALIGN) * ALIGN
        return out

    @property
    def total(self) -> int:
        """The stream's length."""
        if not self.names:
            return 0
        return self.offsets[-1] + self.nbytes(len(self.names) - 1)

    def difference(self, other: WeightMeta) -> str:
        """What differs, for an error message (empty if nothing does)."""
        mine = dict(zip(self.names, zip(self.dtype_names, self.shapes, strict=True), strict=True))
        theirs = dict(zip(other.names, zip(other.dtype_names, other.shapes, strict=True),
                          strict=True))  # fmt: skip
        parts = []
        missing = [n for n in mine if n not in theirs]
        extra = [n for n in theirs if n not in mine]
        changed = [f"{n}: {_show(mine[n])} vs {_show(theirs[n])}"
                   for n in mine if n in theirs and mine[n] != theirs[n]]  # fmt: skip
        if missing:
            parts.append(f"missing from the sent weights: {_few(missing)}")
        if extra:
            parts.append(f"not expected: {_few(extra)}")
        if changed:
            parts.append(f"expected vs sent: {_few(changed)}")
        if not parts and self.names != other.names:
            parts.append("the same weights in another order")
        return "; ".join(parts)


def _show(entry: tuple[str, tuple[int, ...]]) -> str:
    return f"{entry[0]}{list(entry[1])}"


def _few(items: Sequence[str], k: int = 3) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def plan(
    meta: WeightMeta, bucket_bytes: int, direct_bytes: int | None = None
) -> list[tuple[int, int, int]]:
    """The sync's broadcasts: ``(start, stop, tensor)`` ranges of the stream, in order.

    A tensor of ``direct_bytes`` or more (default: ``bucket_bytes``) is a range of its own
    (``tensor`` is its index: the sender broadcasts its memory as it is, no copy); smaller ones are
    packed together into ranges of at most ``bucket_bytes`` (``tensor`` -1), where one broadcast
    per tensor would cost more than the copy. Empty tensors take no range."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    direct = bucket_bytes if direct_bytes is None else min(direct_bytes, bucket_bytes)
    out: list[tuple[int, int, int]] = []
    start = stop = -1  # the packed range being filled
    for i, at in enumerate(meta.offsets):
        n = meta.nbytes(i)
        if not n:
            continue
        if n >= direct:
            if start >= 0:
                out.append((start, stop, -1))
                start = -1
            out.append((at, at + n, i))
            continue
        if start >= 0 and at + n - start > bucket_bytes:
            out.append((start, stop, -1))
            start = -1
        if start < 0:
            start = at
        stop = at + n
    if start >= 0:
        out.append((start, stop, -1))
    return out


def pack(
    meta: WeightMeta,
    weights: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    start: int = 0,
    stop: int | None = None,
) -> None:
    """Copy the bytes ``[start, stop)`` of the stream of ``weights`` (matching ``meta``) into the
    uint8 buffer ``out``, which holds that range (``stop - start`` bytes): one bucket at a time,
    so the next bucket is packed while the earlier ones are on the wire."""
    stop = meta.total if stop is None else stop
    for i, (name, at) in enumerate(zip(meta.names, meta.offsets, strict=True)):
        end = at + meta.nbytes(i)
        lo, hi = max(at, start), min(end, stop)
        if lo >= hi:
            if at >= stop:
                break
            continue
        raw = weights[name].detach().reshape(-1).view(torch.uint8)
        out[lo - start : hi - start].copy_(raw[lo - at : hi - at], non_blocking=True)


def unpack(meta: WeightMeta, stream: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights as views of the uint8 ``stream`` (no copy)."""
    out = {}
    for i, (name, at) in enumerate(zip(meta.names, meta.offsets, strict=True)):
        dtype, shape = _DTYPES[meta.dtype_names[i]], meta.shapes[i]
        raw = stream[at : at + meta.nbytes(i)]
        out[name] = (
            raw.view(dtype).reshape(shape)
            if raw.numel()
            else torch.empty(shape, dtype=dtype, device=stream.device)
        )
    return out
