"""The controller state as a checkpoint holds it (the rebuilding is :mod:`.restore`). Pure: no I/O.

:func:`take` runs in one step of the controller loop, so what it captures is consistent: the
committed rows with their keys, groups, versions, tags of the production matrix (``written`` and
the write sequence that orders reads), every task's acked rows and counters, the partitions'
settings (registered tasks, ttl, producers and closes, schemas) and the admissions' state. What is
in flight is left out, because the processes it belongs to do not survive a restart: uncommitted
puts and ``put_fields`` (their rows, fields and bytes), leases (their rows are saved available),
parked gets and acquires. A ttl keeps the time it had left.

"""

from __future__ import annotations

from typing import Any

import msgspec

from tqstream.controller.partition import Partition
from tqstream.controller.rows import COMMITTED, Row
from tqstream.controller.shapes import ShapesEntry
from tqstream.controller.state import ControllerState
from tqstream.types import FieldSchema

__all__ = ["FORMAT", "ControllerSnapshot", "FileEntry", "Taken", "take"]

FORMAT = 1
"""Version of the snapshot layout; a checkpoint of another version is refused, not guessed at."""

Mask = int | str
"""A field bitmask; as hex text beyond 63 bits (msgpack integers are 64-bit)."""


class RowsTable(msgspec.Struct, frozen=True):
    """A partition's committed rows, one list per attribute (compact in msgpack)."""

    ids: list[int]
    keys: list[str]
    groups: list[str | None]
    nbytes: list[int]
    version_start: list[int | None]
    version_end: list[int | None]
    dispatch_version: list[int | None]
    written: list[Mask]
    ready_seq: list[int]
    writes: list[list[tuple[Mask, int]]]
    tags: list[dict[str, Any] | None] = []  # [] when no row has tags


class GroupEntry(msgspec.Struct, frozen=True, array_like=True):
    name: str
    size: int
    fields: list[str]
    members: list[int]


class TaskEntry(msgspec.Struct, frozen=True):
    name: str
    acked: list[int]
    stale_dropped: int = 0
    lag: dict[int, int] = {}
    lost: int = 0
    consumed: int = 0
    tokens_masked: int = 0


class TtlEntry(msgspec.Struct, frozen=True, array_like=True):
    left: float  # seconds the rows had left to live at the snapshot
    rows: list[int]


class PartitionEntry(msgspec.Struct, frozen=True):
    name: str
    key_prefix: str
    fields: list[str]  # in bit order: field i is bit 1 << i of the masks
    schemas: dict[str, FieldSchema]
    rows: RowsTable
    groups: list[GroupEntry]
    tasks: list[TaskEntry]
    next_row: int
    seq: int
    born: int
    registered: list[str]
    ttl: float | None
    ttl_left: list[TtlEntry]
    admission: str | None
    produced: int
    rejected: int
    stale_dropped: int
    expired: int
    freed: int
    producers: int
    closes: int
    lost: int = 0
    replicas: int | None = None  # copies of each row; None: the controller's default
    shapes: dict[str, ShapesEntry] = {}  # fields put through the TransferQueue layer


class AdmissionEntry(msgspec.Struct, frozen=True):
    name: str
    style: str
    config: dict[str, int]
    counters: dict[str, int | None]
    live: dict[int, int]  # slots granted and not released: id -> the window/version it counts in


class FileEntry(msgspec.Struct, frozen=True):
    """A file of chunks written by storage unit ``unit``: the rows of one partition it holds."""

    unit: int
    name: str  # relative to the checkpoint directory
    partition: str
    row_ids: list[int]
    nbytes: int


class ControllerSnapshot(msgspec.Struct, frozen=True):
    format: int
    next_id: int  # every lease, put and chunk id issued before the snapshot is smaller
    units: int
    partitions: list[PartitionEntry]
    admissions: list[AdmissionEntry]
    next_rows: dict[str, int]  # first row id of a re-created partition (see ControllerState)
    files: list[FileEntry] = []


class Taken(msgspec.Struct, frozen=True):
    """What :func:`take` returns: the snapshot (without its files, which the units name once they
    wrote them) and what each storage unit must save: per unit, the rows of each partition it
    holds; ``before_chunk`` and the chunks of puts still in flight bound what it may save."""

    snapshot: ControllerSnapshot
    rows: dict[int, dict[str, list[int]]]
    before_chunk: int
    skip_chunks: dict[int, list[int]]


def _mask_out(mask: int) -> Mask:
    return mask if mask < 1 << 63 else format(mask, "x")


def _mask_in(mask: Mask) -> int:
    return mask if isinstance(mask, int) else int(mask, 16)


def take(state: ControllerState, now: float) -> Taken:
    """Snapshot ``state`` (see the module docstring); run it within one step of the loop."""
    before = state.ids.peek()  # taken, it would be a change a journal's replay does not see
    extra: dict[tuple[str, int], int] = {}  # bytes of put_fields in flight, not in the snapshot
    skip: dict[int, list[int]] = {}
    for put in state.puts.values():
        for unit, chunk in put.chunks:
            skip.setdefault(unit, []).append(chunk)
        if not put.new_rows and not put.cancelled:
            for rid in put.ids:
                extra[put.partition, rid] = extra.get((put.partition, rid), 0) + put.per_row
    ttls: dict[str, list[TtlEntry]] = {}
    for deadline, kind, ref in state.deadlines.entries():
        owner: Partition | None = ref[0] if kind == "ttl" else None
        if owner is None or state.partitions.get(owner.name) is not owner:
            continue  # another kind, or a partition cleared since
        alive = [rid for rid in ref[1] if owner.rows.committed(rid)]
        if alive:
            ttls.setdefault(owner.name, []).append(TtlEntry(max(deadline - now, 0.0), alive))
    by_unit: dict[int, dict[str, list[int]]] = {}
    parts = []
    for p in state.partitions.values():
        rows = list(p.rows.values(COMMITTED))
        for r in rows:
            if r.written:  # a row without fields (only a key and tags) has nothing stored
                by_unit.setdefault(r.unit, {}).setdefault(p.name, []).append(r.id)
        parts.append(_partition(p, rows, extra, ttls.get(p.name, [])))
    admissions = []
    for name, (adm, style, config) in state.admissions.items():
        counters, live = adm.checkpoint()
        admissions.append(AdmissionEntry(name, style, dict(config), counters, live))
    snapshot = ControllerSnapshot(
        format=FORMAT,
        next_id=before,
        units=len(state.units),
        partitions=parts,
        admissions=admissions,
        next_rows=dict(state.next_rows),
    )
    return Taken(snapshot, by_unit, before, skip)


def _partition(
    p: Partition, rows: list[Row], extra: dict[tuple[str, int], int], ttls: list[TtlEntry]
) -> PartitionEntry:
    committed = {r.id for r in rows}
    table = RowsTable(
        ids=[r.id for r in rows],
        keys=[p.key_of(r) for r in rows],
        groups=[r.group for r in rows],
        nbytes=[r.nbytes - extra.get((p.name, r.id), 0) for r in rows],
        version_start=[r.version_start for r in rows],
        version_end=[r.version_end for r in rows],
        dispatch_version=[r.dispatch_version for r in rows],
        written=[_mask_out(r.written) for r in rows],
        ready_seq=[r.ready_seq for r in rows],
        writes=[[(_mask_out(m), s) for m, s in Partition.writes_of(r)] for r in rows],
        tags=[r.tags for r in rows] if any(r.tags for r in rows) else [],
    )
    groups = []
    for name, g in p.groups.items():
        members = [m for m in g.members if m in committed]
        if members:  # a group whose every member is still being put is not in the snapshot
            groups.append(GroupEntry(name, g.size, sorted(g.fields), members))
    tasks = [
        TaskEntry(
            name,
            sorted(t.acked & committed),
            t.stale_dropped,
            dict(t.lag),
            t.lost,
            t.consumed,
            t.tokens_masked,
        )
        for name, t in p.tasks.items()
    ]
    return PartitionEntry(
        name=p.name,
        key_prefix=p.key_prefix,
        fields=list(p.bits),
        schemas={f: s for f, s in p.schemas.items() if f not in p.provisional},  # no put in flight
        rows=table,
        groups=groups,
        tasks=tasks,
        next_row=p.next_row,
        seq=p.seq,
        born=p.born,
        registered=list(p.registered),
        ttl=p.ttl,
        ttl_left=ttls,
        admission=p.admission,
        produced=p.produced,
        rejected=p.rejected,
        stale_dropped=p.stale_dropped,
        expired=p.expired,
        freed=p.freed,
        producers=p.producers,
        closes=p.closes,
        lost=p.lost,
        replicas=p.replicas,
        shapes=p.shapes.save(committed) if p.shapes else {},
    )
