"""Ragged rows into a padded buffer at the floor: one allocation, the pad written once (or not at
all: a zero pad is the kernel's zeroed pages), one copy of each row.

Shared by the padded torch read (:mod:`tqstream.convert.tensordict`) and the JAX adapter's
buckets. numpy arrays throughout (a row's copy costs a microsecond, a torch slice several), over
the bits of the values where numpy lacks the dtype (bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ALIGN", "aligned_empty", "copy_rows"]

ALIGN = 64
"""The start of every buffer made here: what XLA's CPU client needs to alias one, and a cache
line."""


def aligned_empty(shape: Sequence[int], dtype: Any, *, zeroed: bool = False) -> np.ndarray:
    """An uninitialised array of ``shape`` at a 64-byte aligned address; ``zeroed``: all zero
    bytes, from ``calloc`` (a large buffer is fresh pages the kernel zeroed: no pass of its own).

    numpy's allocator, not torch's: numpy asks the kernel for transparent huge pages for a buffer
    of 4 MiB or more (``madvise``), torch does not, and a padded read writes into fresh memory,
    whose first write faults it in page by page: with 4 KiB pages that costs several times the
    write itself (filling 32 MB: 16 ms against 2, transparent huge pages in ``madvise`` mode)."""
    np_dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    raw = (np.zeros if zeroed else np.empty)(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes].view(np_dtype).reshape(tuple(shape))


def copy_rows(out: np.ndarray, src: np.ndarray, offsets: np.ndarray) -> None:
    """Row ``i`` of ``src`` (``src[offsets[i]:offsets[i + 1]]``) into ``out[i, :length]``, for
    every row; ``out`` holds the pad already. Values are converted to ``out``'s dtype on the way
    (the caller checked they fit)."""
    n = offsets.shape[0] - 1
    if n and src.shape[0] == n * out.shape[1]:  # every row already of the padded length
        out.reshape(-1, *out.shape[2:])[...] = src
        return
    bounds = offsets.tolist()
    for i in range(n):
        start, stop = bounds[i], bounds[i + 1]
        if stop > start:
            out[i, : stop - start] = src[start:stop]
