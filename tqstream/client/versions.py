"""Per-row policy versions, derived at put from a per-token versions field.

A rollout's tokens can be generated under several policy versions (weights updated mid-generation).
Each row carries ``version_start`` (the oldest version among its generated tokens — AReaL's
staleness bound) and ``version_end`` (the newest). Prompt positions carry -1 and are ignored. A row
without generated tokens, or a put without a versions field, takes the ``version`` given to put.
Computed in the producer's process, vectorised over the batch, so the controller never sees tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tqstream.errors import SchemaError
from tqstream.protocol.columns import DTYPES, Column
from tqstream.protocol.parts import STAGE_BYTES, between, stage
from tqstream.types import FieldSchema

_INTEGER = {"int8", "int16", "int32", "int64", "uint8"}


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
    n = col.n_rows
    if col.in_parts and col.schema.kind == "ragged" and n > 1:
        lo, hi = _staged(col)  # rows as the put was given them: never joined
    else:
        flat = col.values.numpy().reshape(-1)
        unsigned = _unsigned(flat)
        if n == 1:  # one trajectory per put: no per-row bounds
            if flat.shape[0] == 0 or (end := int(flat.max())) < 0:  # no generated token
                return [fallback], [fallback]
            return [int(unsigned.min())], [end]
        if col.schema.kind == "dense":
            if flat.shape[0] == 0:
                return [fallback] * n, [fallback] * n
            lo = unsigned.reshape(n, -1).min(axis=1)
            hi = flat.reshape(n, -1).max(axis=1)
        else:  # numpy: small per-trajectory puts cost microseconds
            assert col.offsets is not None
            lo = np.zeros(n, dtype=unsigned.dtype)
            hi = np.full(n, -1, dtype=np.int64)
            _reduce(flat, col.offsets.numpy(), lo, hi)
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


def _unsigned(flat: np.ndarray) -> np.ndarray:
    """The same bits as unsigned: a negative (prompt) position becomes larger than any version, so
    a plain min skips it (one vectorised pass each for min and max, no copy, no mask)."""
    return flat if flat.dtype == np.uint8 else flat.view(f"u{flat.dtype.itemsize}")


def _reduce(flat: np.ndarray, bounds: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """``lo`` / ``hi``: the min over the unsigned view and the max of each row of ``flat`` that
    has values (row ``i`` is ``flat[bounds[i]:bounds[i + 1]]``); empty rows are left as they are."""
    full = bounds[1:] > bounds[:-1]  # rows with at least one token
    if full.any():
        at = bounds[:-1][full]  # reduceat spans each start to the next: empty rows skipped
        lo[full] = np.minimum.reduceat(_unsigned(flat), at)
        hi[full] = np.maximum.reduceat(flat, at)


def _staged(col: Column) -> tuple[np.ndarray, np.ndarray]:
    """Per-row bounds of a ragged column in parts, its rows gathered a window at a time into a
    buffer that stays in cache (a row larger than the window is read where it is): a read of the
    parts and the two passes over cached memory, where joining them first would write the whole
    column out to memory and read it back twice."""
    assert col.offsets is not None
    offsets, n = col.offsets.numpy(), col.n_rows
    dtype = DTYPES[col.schema.dtype]
    window = STAGE_BYTES // dtype.itemsize
    buffer = stage(min(col.n_values, window) * dtype.itemsize).view(dtype)
    staged = buffer.numpy()
    rows = col.pieces()
    lo = np.zeros(n, dtype=_unsigned(staged).dtype)
    hi = np.full(n, -1, dtype=np.int64)
    a = 0
    while a < n:  # rows a..b-1 in one window (row a alone if larger)
        b = max(a + 1, int(np.searchsorted(offsets, offsets[a] + window, side="right")) - 1)
        start, stop = int(offsets[a]), int(offsets[b])
        pieces, _ = between(*rows, start, stop)
        if stop - start > window:
            with torch.no_grad():
                flat = (torch.cat(pieces) if len(pieces) > 1 else pieces[0].detach()).numpy()
        elif stop > start:
            with torch.no_grad():
                torch.cat(pieces, out=buffer[: stop - start])
            flat = staged[: stop - start]
        if stop > start:
            _reduce(flat, offsets[a : b + 1] - start, lo[a:b], hi[a:b])
        a = b
    return lo, hi


FRESH_MASK = "fresh_mask"
"""The field a ``measure="token"`` read adds: per token, whether it is inside the window."""


def fresh_mask(
    columns: dict[str, Column],
    versions_field: str,
    current_version: int | None,
    max_staleness: int | None,
    keep_versions: bool,
) -> tuple[dict[str, Column], int]:
    """``columns`` with :data:`FRESH_MASK` added: a ``bool`` field aligned with the per-token
    versions field (ragged or dense, as it is), True where ``current_version - versions[t] <=
    max_staleness`` (a prompt position, version -1, is False); the versions field itself is
    dropped unless ``keep_versions``. Also returns how many generated tokens (version >= 0) fell
    outside. Without a window (``max_staleness`` None) every generated token is inside."""
    col = columns.get(versions_field)
    if col is None or col.schema.kind == "object" or col.schema.dtype not in _INTEGER:
        found = "no such field" if col is None else col.schema.describe()
        raise SchemaError(
            f"a measure='token' read needs the per-token versions field {versions_field!r} "
            f"(int, one policy version per token, -1 on prompt tokens), got {found}; name "
            f"it with versions_field=",
            field=versions_field,
        )
    versions = col.values.to(torch.int64)
    generated = versions >= 0
    if current_version is None or max_staleness is None:  # no window: every generated token
        fresh = generated
    else:
        fresh = generated & (current_version - versions <= max_staleness)
    out = {k: c for k, c in columns.items() if keep_versions or k != versions_field}
    schema = FieldSchema(col.schema.kind, "bool", tuple(col.schema.shape))
    out[FRESH_MASK] = Column(schema, fresh, col.offsets)
    return out, int(generated.sum()) - int(fresh.sum())


def tokens_outside(data: Any, versions_field: str) -> int:
    """Generated tokens of a token-measure read's TensorDict (jagged, or padded with
    ``<versions_field>_lengths``) outside its window: what ``meta.tokens_masked`` counts."""
    versions, fresh = data.get(versions_field), data.get(FRESH_MASK)
    if versions.is_nested:
        versions, fresh = versions.values(), fresh.values()
    elif f"{versions_field}_lengths" in data.keys():  # noqa: SIM118 (a TensorDict)
        lengths = data.get(f"{versions_field}_lengths")
        valid = torch.arange(versions.shape[1])[None, :] < lengths[:, None]
        versions, fresh = versions[valid], fresh[valid]
    return int((versions >= 0).sum()) - int(fresh.sum())
