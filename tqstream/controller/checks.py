"""The checks of a write request and the errors of a write, apart from the put book and the
tables a write changes (:mod:`.puts`): each reads what it is given and changes nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tqstream.controller.partition import Partition
from tqstream.controller.rows import Row, check_versions
from tqstream.controller.shapes import shapes_problem
from tqstream.controller.units import UnitTable
from tqstream.errors import (
    CapacityError,
    DuplicateKeyError,
    FieldExistsError,
    InvalidRequestError,
    PartitionClearedError,
    PlacementRequiredError,
    RequestTimeoutError,
    TQStreamError,
    UnitLostError,
)
from tqstream.protocol.messages import PrepareFields, PreparePut


def check_put(req: PreparePut) -> None:
    """Refuse a put whose per-row lists do not match its rows, or whose versions are out of
    range."""
    if req.n_rows <= 0 or not req.schemas:
        raise InvalidRequestError(
            f"a put needs at least one row and one field (got "
            f"{req.n_rows} rows, {len(req.schemas)} fields)"
        )
    for name, seq in (("keys", req.keys), ("groups", req.groups), ("tags", req.tags)):
        if seq is not None and len(seq) != req.n_rows:
            raise InvalidRequestError(
                f"{name}= has {len(seq)} entries but the put has {req.n_rows} rows"
            )
    if req.group_size is not None and req.group_size <= 0:
        raise InvalidRequestError(f"group_size must be positive, got {req.group_size}")
    for vname, vseq in (
        ("version_start", req.version_start),
        ("version_end", req.version_end),
        ("dispatch_version", req.dispatch_version),
    ):
        if vseq is not None and len(vseq) != req.n_rows:
            raise InvalidRequestError(
                f"{vname} has {len(vseq)} entries but the put has {req.n_rows} rows"
            )
    problem = shapes_problem(req.shapes, req.schemas, req.n_rows)
    if problem is not None:
        raise InvalidRequestError(problem)
    check_versions([req.version], "version")
    check_versions(req.version_start, "version_start")
    check_versions(req.version_end, "version_end")
    check_versions(req.dispatch_version, "dispatch_version")


def check_fields(req: PrepareFields) -> list[Any]:
    """Refuse a put_fields that names no row or one twice, or whose per-row lists do not match;
    returns the rows it names (keys or row ids)."""
    named: list[Any] = req.keys if req.keys is not None else req.row_ids
    if not named or not req.schemas:
        raise InvalidRequestError("put_fields needs at least one row and one field")
    for what, seq in (
        ("tags", req.tags),
        ("version_start", req.version_start),
        ("version_end", req.version_end),
    ):
        if seq is not None and len(seq) != len(named):
            raise InvalidRequestError(
                f"{what}= has {len(seq)} entries but the write names {len(named)} rows"
            )
    problem = shapes_problem(req.shapes, req.schemas, len(named))
    if problem is not None:
        raise InvalidRequestError(problem)
    if len(set(named)) < len(named):
        twice = next(r for i, r in enumerate(named) if r in named[:i])
        raise InvalidRequestError(
            f"put_fields names row {twice!r} more than once; a field is written once per row",
            row=twice,
        )
    return named


def check_writable(p: Partition, req: PrepareFields, rows: list[Row], n: int) -> None:
    """Refuse a write of fields the rows have (unless ``overwrite``) or that another write in
    flight is writing."""
    for name in req.schemas:
        bit = p.bits.get(name, 0)
        if req.overwrite:
            taken = [p.key_of(r) for r in rows if r.pending & bit]
            what, advice = "being written by another put_fields in flight", "retry once it ends"
        else:
            taken = [p.key_of(r) for r in rows if (r.written | r.pending) & bit]
            what = "already written (or being written)"
            advice = "fields cannot be overwritten: write the new values under another name"
            if req.keys is not None:
                advice += " (or pass overwrite=True)"
        if taken:
            raise FieldExistsError(
                f"field {name!r} is {what} for {len(taken)} of the {n} rows in "
                f"partition {req.partition!r} (e.g. key {taken[0]!r}); {advice}",
                field=name,
                rows=len(taken),
            )


def put_error(put_id: int, status: str | None, put_timeout: float) -> TQStreamError:
    """What a commit or abort of put ``put_id``, which ended with ``status``, raises."""
    if status == "expired":
        return RequestTimeoutError(
            f"put {put_id} was not committed within put_timeout={put_timeout}s and was "
            f"rolled back (no rows, no bytes kept); retry the put",
            put_id=put_id,
        )
    if status == "unit-lost":
        return UnitLostError(
            f"put {put_id} was rolled back: a storage unit it was stored on was lost before "
            f"the commit (nothing was kept); retry the put",
            put_id=put_id,
        )
    if status == "cleared":
        return PartitionClearedError(
            f"the partition of put {put_id} was cleared while the put was in flight; nothing "
            f"was stored",
            put_id=put_id,
        )
    return InvalidRequestError(
        f"put {put_id} is unknown or already {status or 'finished'}", put_id=put_id
    )


def capacity_error(req: PreparePut, waited: float, units: UnitTable) -> CapacityError:
    """A put that waited ``waited`` seconds for room under the units' quotas, in vain."""
    free = sum(
        q - b for q, b, ok in zip(units.quota, units.bytes, units.alive, strict=True) if q and ok
    )
    return CapacityError(
        f"a put of {req.n_rows} rows ({req.nbytes} bytes) to partition {req.partition!r} did "
        f"not fit in storage within {waited:.1f}s: {free} bytes free under the units' quotas "
        f"({sum(units.quota)} in all); consume and ack (registered tasks free rows), "
        f"clear rows, or raise max_bytes on the storage units",
        nbytes=req.nbytes,
        free=free,
    )


def same_put(a: PreparePut, b: PreparePut) -> bool:
    """The two copies of a replicated put describe the same rows."""
    return msgspec.structs.replace(a, rid=0) == msgspec.structs.replace(b, rid=0)


def check_upsert(keys: list[str], tags: list[Any] | None) -> None:
    """Refuse a keyed write of tags whose tags do not match its keys, or naming a key twice."""
    if tags is not None and len(tags) != len(keys):
        raise InvalidRequestError(f"tags= has {len(tags)} entries but {len(keys)} keys were given")
    if len(set(keys)) < len(keys):
        twice = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise InvalidRequestError(f"key {twice!r} is named more than once", key=twice)


def rows_by_key(
    p: Partition, keys: Sequence[str], create: bool
) -> tuple[list[Row | None], list[str]]:
    """The committed rows of ``keys`` (None for keys to create) and the keys to create; a key
    that does not exist without ``create``, or that a put in flight is creating, raises."""
    rows: list[Row | None] = []
    new: list[str] = []
    for k in keys:
        r = p.row_of_key(k)
        if r is not None and not r.committed:
            raise DuplicateKeyError(
                f"key {k!r} of partition {p.name!r} is being created by a put in flight; "
                f"write to it once that put has committed",
                partition=p.name,
                count=1,
            )
        rows.append(r)
        if r is None:
            new.append(k)
    if new and not create:
        raise p.unknown_keys(new, len(keys))
    return rows, new


def check_pair(req: PreparePut, unit: int, replicas: int, units: UnitTable) -> None:
    """Refuse one copy of a replicated one-exchange put that reached a unit not of its pair, a
    pair of one unit, a partition of one copy, or a pair with a lost unit."""
    pair = req.pair
    assert pair is not None
    if unit not in pair.units or pair.units[0] == pair.units[1]:
        raise InvalidRequestError(
            f"a put sent to units {pair.units} reached unit {unit}: the two units of a "
            f"replicated put are two different units, and each copy goes to one of them"
        )
    if replicas < 2:
        raise PlacementRequiredError(
            f"partition {req.partition!r} keeps one copy of each row: a put to it goes to "
            f"one unit, not two; put again (the client does so by itself)",
            partition=req.partition,
            replicas=1,
        )
    for u in pair.units:
        if 0 <= u < len(units.alive) and not units.alive[u]:
            raise UnitLostError(
                f"storage unit {u} ({units.addresses[u]}), one of the two units of this "
                f"replicated put, was declared lost; nothing was stored: put again",
                unit=u,
                partition=req.partition,
            )


def check_rows(partitions: Mapping[str, Partition], max_rows: int, partition: str, n: int) -> None:
    """Refuse ``n`` new rows for ``partition`` beyond the cluster's ``max_rows`` (0: no cap)."""
    if not max_rows or not n:
        return
    held = sum(len(p.rows) for p in partitions.values())
    if held + n > max_rows:
        raise CapacityError(
            f"the cluster holds {held} rows and max_rows={max_rows}: {n} more rows for "
            f"partition {partition!r} do not fit; clear or consume rows first, or raise "
            f"max_rows (TransferQueue's total_storage_size)",
            rows=held,
            max_rows=max_rows,
        )
