"""Per-row policy versions, derived at put from a per-token versions field.

A rollout's tokens can be generated under several policy versions (weights updated mid-generation).
Each row carries ``version_start`` (the oldest version among its generated tokens — AReaL's
staleness bound) and ``version_end`` (the newest). Prompt positions carry -1 and are ignored. A row
without generated tokens, or a put without a versions field, takes the ``version`` given to put.
Computed in the producer's process, vectorised over the batch, so the controller never sees tokens.
"""

from __future__ import annotations

import numpy as np

from tqstream.errors import InvalidRequestError, SchemaError
from tqstream.protocol.codec import Column

_INTEGER = {"int8", "int16", "int32", "int64", "uint8"}


def check_version(value: object, name: str) -> int | None:
    """A policy version given to a call (``version=``, ``current_version=``): None or an int >= 0
    (numpy integers too), else ``InvalidRequestError`` saying what a version is."""
    if value is None:
        return None
    if isinstance(value, np.integer):
        value = int(value)
    if type(value) is not int or value < 0:
        raise InvalidRequestError(
            f"{name} must be a policy version: an int >= 0 (the trainer's weight version, bumped "
            f"at each update), or None; got {value!r}",
            **{name: repr(value)},
        )
    return value


_NONE = np.iinfo(np.int64).max  # "no generated token" in a row's minimum


def row_versions(
    name: str, col: Column, fallback: int | None
) -> tuple[list[int | None], list[int | None]]:
    """``(version_start, version_end)`` per row of the per-token versions column ``col``."""
    ndim = {"ragged": 0, "dense": 1}.get(col.schema.kind)
    if ndim is None or col.schema.dtype not in _INTEGER or len(col.schema.shape) != ndim:
        raise SchemaError(
            f"the versions field {name!r} must hold one integer per token (ragged or dense "
            f"int[L]), got {col.schema.describe()}; pass versions_field=None to use only version=",
            field=name,
        )
    flat = col.values.numpy().astype(np.int64, copy=False).reshape(-1)
    if col.schema.kind == "ragged":  # numpy: small per-trajectory puts cost microseconds
        assert col.offsets is not None
        bounds = col.offsets.numpy()
    else:
        bounds = np.arange(col.n_rows + 1, dtype=np.int64) * (flat.shape[0] // max(col.n_rows, 1))
    lo = np.full(col.n_rows, _NONE, dtype=np.int64)
    hi = np.full(col.n_rows, -1, dtype=np.int64)
    full = bounds[1:] > bounds[:-1]  # rows with at least one token
    if full.any():
        at = bounds[:-1][full]  # reduceat spans each start to the next: empty rows are skipped
        lo[full] = np.minimum.reduceat(np.where(flat >= 0, flat, _NONE), at)
        hi[full] = np.maximum.reduceat(flat, at)
    starts: list[int | None] = []
    ends: list[int | None] = []
    for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
        if b < 0:  # no generated token: the producer's version
            starts.append(fallback)
            ends.append(fallback)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends
