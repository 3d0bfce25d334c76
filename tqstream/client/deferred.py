"""Deferred encoding: puts that will be coalesced are encoded together, once.

Encoding a put's input (its columns, checked, and its rows' policy versions) has a cost per call
that dwarfs the per-row cost for one-trajectory puts: ~120 µs a row on its own against ~30 µs a
row as a batch of 32. Rollouts in flight put one trajectory each, and their puts are coalesced
anyway (``coalesce.py``), so a put of a coalescing client whose input has the *signature* of one
this client has encoded before — the same field names, each a tensor or a list of tensors of the
same dtype and trailing shape, and the same versions field — is not encoded in its call: its
schemas (what its merge key needs) are those that put had, and the puts it is merged with are
encoded as one batch when they are sent. A put sent alone is encoded alone.

What the eager encoding gives each caller stays: a signature is learnt only from a put encoded in
full (every check passed), and a deferred input is only what those checks accept (CPU tensors,
strided, at least one dimension, no autograd, the same row count in every field), so bad data is
still refused in its own caller's call, before anything is sent. Everything that is not about the
tensors (keys, groups, tags, versions given as arguments) is checked in the call as before.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable
from typing import Any

import msgspec
import numpy as np
import torch

from tqstream.client.versions import row_versions
from tqstream.convert.inputs import columns_from_data
from tqstream.errors import SchemaError
from tqstream.protocol.columns import WIRE_NAMES, Column
from tqstream.protocol.messages import PreparePut
from tqstream.types import FieldSchema

__all__ = ["Deferred", "Signatures", "encode_batch", "encoded"]

Input = dict[str, "torch.Tensor | list[torch.Tensor]"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Deferred:
    """A put's input, not encoded yet. Its tensors are the caller's (who must not change them
    until the put returns, as with every put)."""

    data: Input
    versions_field: str | None

    def encode(self, req: PreparePut) -> tuple[PreparePut, dict[str, Column]]:
        """The put on its own: its columns, and ``req`` with its rows' versions."""
        _, columns = columns_from_data(self.data)
        starts = ends = None
        field = self.versions_field
        if field is not None and field in columns:
            starts, ends = row_versions(field, columns[field], req.version)
        req = msgspec.structs.replace(
            req,
            schemas={k: c.schema for k, c in columns.items()},
            nbytes=sum(c.nbytes for c in columns.values()),
            version_start=starts,
            version_end=ends,
        )
        return req, columns


def encoded(
    req: PreparePut, columns: dict[str, Column] | Deferred
) -> tuple[PreparePut, dict[str, Column]]:
    """A put's request and columns, encoded now if they were deferred."""
    return columns.encode(req) if isinstance(columns, Deferred) else (req, columns)


def encode_batch(
    reqs: list[PreparePut], inputs: list[Deferred]
) -> tuple[list[PreparePut], dict[str, Column]]:
    """Deferred puts of one merge key as one batch: each request with its rows' versions, and
    the columns of all their rows in order, in parts (the inputs' tensors, each copied once by
    the writer that sends them). Their signatures say every input is well formed (see the module
    docstring), so the columns are built without the per-row checks of a put; each input's
    dtype and trailing shape are checked against the requests' schemas all the same."""
    schemas = reqs[0].schemas
    columns: dict[str, Column] = {}
    for name, schema in schemas.items():
        parts = [d.data[name] for d in inputs]
        # every row of an input has its first row's dtype and trailing shape (Signatures.of)
        for part in parts:
            first = part if isinstance(part, torch.Tensor) else part[0]
            if WIRE_NAMES.get(first.dtype) != schema.dtype or first.shape[1:] != schema.shape:
                got = f"{first.dtype} {tuple(first.shape[1:])}"
                raise SchemaError(
                    f"field {name!r}: {schema.describe()} expected, the batch has {got}"
                )
        if schema.kind == "dense":
            starts = np.zeros(len(parts) + 1, np.int64)
            starts[1:] = list(itertools.accumulate(r.n_rows for r in reqs))
            columns[name] = Column.from_parts(schema, parts, starts)  # type: ignore[arg-type]
            continue
        rows: list[torch.Tensor] = list(itertools.chain.from_iterable(parts))
        offsets = np.zeros(len(rows) + 1, np.int64)
        offsets[1:] = list(itertools.accumulate(t.shape[0] for t in rows))
        columns[name] = Column.from_parts(schema, rows, offsets, torch.from_numpy(offsets))
    bounds: dict[str, tuple[list[int | None], list[int | None]]] = {}
    out, start = [], 0
    for req, d in zip(reqs, inputs, strict=True):
        stop, field = start + req.n_rows, d.versions_field
        if field is not None and field in columns:
            if field not in bounds:
                bounds[field] = row_versions(field, columns[field], None)
            lo, hi = bounds[field]
            fill = req.version
            req = msgspec.structs.replace(
                req,
                version_start=[fill if v is None else v for v in lo[start:stop]],
                version_end=[fill if v is None else v for v in hi[start:stop]],
            )
        out.append(req)
        start = stop
    return out, columns


_PLAIN = frozenset(dt for dt in WIRE_NAMES if not dt.is_complex)  # complex: lazy conj bits
_STRIDED = torch.strided


def _row(t: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """``(dtype, trailing shape)`` of a tensor a put takes as it is (see the module docstring),
    else None. Each check is a tensor attribute read (~0.1 µs): this runs for every tensor of
    every put a coalescing client makes."""
    if (
        type(t) is not torch.Tensor
        or not t.is_cpu
        or t.is_nested
        or t.requires_grad
        or t.layout is not _STRIDED
    ):
        return None
    ndim, dtype = t.ndim, t.dtype
    if not ndim or dtype not in _PLAIN:
        return None
    return dtype, () if ndim == 1 else tuple(t.shape[1:])


class Signatures:
    """The schemas of the inputs a client has encoded, by signature (see the module docstring).
    Safe to use from several threads: entries are only added, each by one dict store."""

    LIMIT = 256
    """Signatures kept; a client that has seen more encodes the others' puts in their calls."""

    def __init__(self, max_bytes: int) -> None:
        self._schemas: dict[Hashable, dict[str, FieldSchema]] = {}
        self.max_bytes = max_bytes
        """Only a put below this size is deferred (``direct_put_bytes``: a put coalescing can
        take); a larger one is encoded in its caller's thread, never on the loop that sends
        the client's other requests."""

    def of(self, data: Any, versions_field: str | None) -> tuple[Hashable, int, int, Input] | None:
        """``(signature, rows, bytes, input)`` of a put's input, or None if it cannot be
        deferred (not a dict of plain tensors and lists of them with one row count, or not
        below ``max_bytes``)."""
        if type(data) is not dict or not data:
            return None
        sig: list[Any] = [versions_field]
        n, nbytes, fields = -1, 0, {}
        for name, value in data.items():
            kind = type(value)
            if kind is torch.Tensor:
                if (row := _row(value)) is None:
                    return None
                rows, size = value.shape[0], value.nbytes
                sig.append((name, False, *row))
            elif (kind is list or kind is tuple) and value:
                row = _row(value[0])
                if row is None:
                    return None
                size = 0
                for t in value:
                    if t is not value[0] and _row(t) != row:
                        return None
                    size += t.nbytes
                    if nbytes + size >= self.max_bytes:  # a large put: not a row more
                        return None
                rows, value = len(value), list(value)  # the caller's list may be reused
                size += 8 * (rows + 1)
                sig.append((name, True, *row))
            else:
                return None
            nbytes += size
            if not rows or (n >= 0 and rows != n) or nbytes >= self.max_bytes:
                return None
            n, fields[name] = rows, value
        return tuple(sig), n, nbytes, fields

    def known(self, signature: Hashable) -> dict[str, FieldSchema] | None:
        return self._schemas.get(signature)

    def learn(self, signature: Hashable, schemas: dict[str, FieldSchema]) -> None:
        """The schemas a put of ``signature`` was encoded with (every check passed)."""
        if len(self._schemas) < self.LIMIT:
            self._schemas[signature] = schemas
