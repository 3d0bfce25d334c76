"""Per-row policy versions, derived at put from a per-token versions field.

A rollout's tokens can be generated under several policy versions (weights updated mid-generation).
Each row carries ``version_start`` (the oldest version among its generated tokens — AReaL's
staleness bound) and ``version_end`` (the newest). Prompt positions carry -1 and are ignored. A row
without generated tokens, or a put without a versions field, takes the ``version`` given to put.
Computed in the producer's process, vectorised over the batch, so the controller never sees tokens.
"""

from __future__ import annotations

import torch

from tqstream.errors import SchemaError
from tqstream.protocol.codec import Column

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
    values = col.values.to(torch.int64)
    if col.schema.kind == "ragged":
        assert col.offsets is not None
        lengths = col.offsets.diff()
        flat = values
    else:
        flat = values.reshape(col.n_rows, -1)
        lengths = torch.full((col.n_rows,), flat.shape[1], dtype=torch.int64)
        flat = flat.reshape(-1)
    generated = flat >= 0
    big = float(torch.iinfo(torch.int64).max)
    lo = torch.segment_reduce(
        torch.where(generated, flat, torch.iinfo(torch.int64).max).double(),
        "min",
        lengths=lengths,
        initial=big,
    )
    hi = torch.segment_reduce(flat.double(), "max", lengths=lengths, initial=-1.0)
    starts: list[int | None] = []
    ends: list[int | None] = []
    for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
        if b < 0:  # no generated token: the producer's version
            starts.append(fallback)
            ends.append(fallback)
        else:
            starts.append(int(a))
            ends.append(int(b))
    return starts, ends
