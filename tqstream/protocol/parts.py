"""Values in parts: a column's values still as the tensors a put was given, copied once, straight
into the segment or frame that carries them.

A put of rows given as a list of tensors (what a rollout worker has) would otherwise concatenate
each field into a values tensor and then copy that into the shared-memory segment or the packed
frame bound for a storage unit: every byte copied twice. A column built from such a list keeps the
rows as they are (:meth:`~tqstream.protocol.columns.Column.from_parts`), and its values go to the
writers as :class:`Parts`, which copy each part into its place: one ``torch.cat(..., out=)`` into
a writer's mapping or a packed frame (the GIL released), or through a cache-sized staging buffer
for a ``write()`` (:meth:`Parts.pwrite`). A frame that ZMQ sends as it is must be one buffer:
:func:`joined` makes one of each ``Parts`` (one copy, into memory the frame then owns).

Buffer lifetimes: the parts are the caller's tensors, so, as for every put, the caller must not
change them until the put returns; a ``Parts`` holds them, not copies.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["STAGE_BYTES", "Parts", "between", "joined", "nbytes", "stage"]

STAGE_BYTES = 1 << 20
"""A ``write()`` of parts goes through a staging buffer this large: the parts are gathered into it
(in cache), the kernel copies it from there. int64 rows of ~8 KiB, on a quiet 2-core VM: 4.2 MB
in 0.55 ms, 15.6 MB in 3.2 ms, where joining them first (a fresh buffer) and writing that takes
0.64 and 3.5 ms; a ``pwritev`` of the rows themselves ~2x that, a mapping made for one write
(``MAP_POPULATE``) and copied into ~1.3x. Smaller stages cost more ``write()`` calls; larger
ones fall out of the 1 MiB L2."""


_STAGES = threading.local()


def stage(size: int) -> torch.Tensor:
    """A uint8 buffer of ``size`` bytes, this thread's, for the length of one call: the same
    memory again on every call (its pages exist and are in cache; a fresh buffer of a few MB
    costs a page fault per 4 KiB on first touch). Nothing may keep it past the call."""
    buffer: torch.Tensor | None = getattr(_STAGES, "buffer", None)
    if buffer is None or buffer.shape[0] < size:
        buffer = _STAGES.buffer = torch.empty(size, dtype=torch.uint8)
    return buffer[:size]


def between(
    parts: list[torch.Tensor], bounds: np.ndarray, lo: int, hi: int
) -> tuple[list[torch.Tensor], np.ndarray]:
    """The values ``[lo, hi)`` of ``parts`` (``bounds[i]`` is where part ``i`` starts in the values,
    ``bounds[-1]`` their number): views of the parts that hold them, and where each starts,
    from 0. No copy."""
    if lo >= hi:
        return [], np.zeros(1, np.int64)
    first = int(np.searchsorted(bounds, lo, side="right")) - 1  # holds lo (not empty)
    end = int(np.searchsorted(bounds, hi, side="left"))  # parts first..end-1 reach hi
    out = list(parts[first:end])
    starts = np.clip(bounds[first : end + 1], lo, hi) - lo
    with torch.no_grad():  # a part may require grad: its views are only ever read
        if bounds[end] > hi:  # the last part reaches past hi (cut first: from its own start)
            out[-1] = out[-1][: hi - int(bounds[end - 1])]
        if bounds[first] < lo:
            out[0] = out[0][lo - int(bounds[first]) :]
    return out, starts


class Parts:
    """The bytes of ``values`` of ``dtype`` and shape ``[bounds[-1], *shape]`` as the tensors
    ``parts`` back to back along their first dimension (``bounds[i]`` where part ``i`` starts), CPU
    tensors of any strides: a buffer that writers copy into place (see the module docstring)."""

    __slots__ = ("bounds", "dtype", "nbytes", "parts", "shape")

    def __init__(
        self,
        parts: list[torch.Tensor],
        bounds: np.ndarray,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> None:
        self.parts = parts
        self.bounds = bounds
        self.dtype = dtype
        self.shape = shape
        self.nbytes = int(bounds[-1]) * math.prod(shape) * dtype.itemsize

    def into(self, out: torch.Tensor) -> None:
        """Copy the parts back to back into ``out``, a uint8 tensor of ``nbytes`` (a view of a
        mapped segment or a frame) whose start is aligned for ``dtype``."""
        if self.nbytes:
            _cat(self.parts, self.dtype, self.shape, out)

    def join(self) -> memoryview:
        """The bytes in one buffer of their own (one copy of each part)."""
        if not self.nbytes:
            return memoryview(b"")
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        self.into(out)
        return out.numpy().data  # the view keeps ``out`` alive

    def pwrite(self, fd: int, offset: int) -> None:
        """Write the bytes to file ``fd`` at ``offset``, staged through a buffer of at most
        ``STAGE_BYTES`` (and at least one value row)."""
        row = math.prod(self.shape) * self.dtype.itemsize
        if not self.nbytes:
            return
        window = max(1, STAGE_BYTES // row)
        staged = stage(min(self.nbytes, window * row))
        for lo, hi in _windows(int(self.bounds[-1]), window):
            pieces, _ = between(self.parts, self.bounds, lo, hi)
            n = (hi - lo) * row
            _cat(pieces, self.dtype, self.shape, staged[:n])
            view = staged[:n].numpy().data
            at = offset + lo * row
            while n:
                done = os.pwrite(fd, view, at)
                view, at, n = view[done:], at + done, n - done


def _cat(
    parts: list[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor
) -> None:
    with torch.no_grad():  # out= refuses inputs that require grad
        torch.cat(parts, out=out.view(dtype).view(-1, *shape))


def _windows(total: int, size: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, total, size):
        yield lo, min(lo + size, total)


def nbytes(buffer: Any) -> int:
    """Bytes of a frame: a :class:`Parts` or any buffer."""
    return buffer.nbytes if type(buffer) is Parts else memoryview(buffer).nbytes


def joined(buffers: Sequence[Any]) -> list[Any]:
    """``buffers`` as ZMQ sends them: every :class:`Parts` joined into one buffer."""
    return [b.join() if type(b) is Parts else b for b in buffers]
