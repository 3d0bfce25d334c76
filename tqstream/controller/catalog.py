"""The controller's partitions by name: created, closed, looked up, their rows evicted.

A :class:`Catalog` owns the partitions (each :class:`~tqstream.controller.partition.Partition`
owns its rows) and the first row id a re-created partition of a name starts at, so that row ids
are never reused under a name. Evicting rows removes them for every task, uncounts their bytes on
their units, has the leases that held them forget them (``on_evict``), and orders their storage
freed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from tqstream.controller.partition import Partition
from tqstream.controller.records import Effects, Ids
from tqstream.controller.rows import SMALL, Row
from tqstream.controller.units import UnitTable
from tqstream.errors import InvalidRequestError, UnknownPartitionError, UnknownRowError
from tqstream.protocol.messages import PackedMeta
from tqstream.types import BatchMeta


class Catalog:
    def __init__(self, units: UnitTable, ids: Ids, replicas: int) -> None:
        self.units = units
        # called with (partition, row ids) of rows evicted: the owners of what names rows (the
        # leases) forget them
        self.on_evict: list[Callable[[str, set[int]], None]] = []
        self.ids = ids
        self.replicas = replicas  # copies of each row, for partitions that do not say
        self.partitions: dict[str, Partition] = {}
        self.next_rows: dict[str, int] = {}  # first row id of a re-created partition

    def __getstate__(self) -> dict[str, Any]:
        """For a journal's snapshot: everything but ``on_evict`` (its owners bind it again)."""
        return {k: (v if k != "on_evict" else []) for k, v in self.__dict__.items()}

    def replicas_of(self, partition: str) -> int:
        p = self.partitions.get(partition)
        return p.replicas if p is not None and p.replicas is not None else self.replicas

    def partition(self, name: str) -> Partition:
        p = self.partitions.get(name)
        if p is None:
            known = ", ".join(repr(k) for k in sorted(self.partitions)) or "none"
            raise UnknownPartitionError(
                f"partition {name!r} does not exist (existing: {known}); put to it first, or "
                f"declare it with create_partition({name!r}, fields=[...]) so that gets wait for "
                f"producers",
                partition=name,
            )
        return p

    def create(
        self,
        name: str,
        fields: list[str],
        tasks: list[str] | None = None,
        ttl: float | None = None,
        admission: str | None = None,
        producers: int | None = None,
        replicas: int | None = None,
    ) -> None:
        if not name:
            raise InvalidRequestError("partition name must be a non-empty string")
        if ttl is not None and ttl <= 0:
            raise InvalidRequestError(f"ttl must be > 0 seconds, got {ttl}")
        if tasks is not None and not all(tasks):
            raise InvalidRequestError("registered task names must be non-empty strings")
        if producers is not None and producers < 1:
            raise InvalidRequestError(
                f"producers must be >= 1 (the close_partition calls that close the partition), "
                f"got {producers}"
            )
        p = self.partitions.get(name)
        if p is None:
            # the incarnation: leases with smaller ids belong to an earlier one, and its rows'
            # bytes are written and read under it (the rows' generation, BatchMeta.generation)
            born = next(self.ids)
            # each incarnation's keys differ from an earlier one's; derived, not drawn: a
            # journal's replay makes the same
            prefix = hashlib.blake2b(f"{name}/{born}".encode(), digest_size=4).hexdigest()
            p = self.partitions[name] = Partition(name, f"{prefix}-")
            p.next_row = self.next_rows.get(name, 0)
            p.born = born
        p.declare(fields)
        if tasks is not None:
            p.registered = list(dict.fromkeys(tasks))
        if ttl is not None:
            p.ttl = ttl
        if admission is not None:
            p.admission = admission
        if producers is not None:
            p.producers = producers
        if replicas is not None:
            if replicas not in (1, 2):
                raise InvalidRequestError(f"replicas must be 1 or 2, got {replicas}")
            p.replicas = replicas

    def close(self, name: str) -> tuple[int, Effects]:
        """One producer is done. Returns the producers still open (0: closed) and the effects:
        parked gets that can now only get a short last batch, or the end of the stream."""
        p = self.partition(name)
        p.closes += 1
        effects = Effects()
        if p.closed:
            effects.touched.add(name)
        return max(p.producers - p.closes, 0), effects

    def count_rejected(self, partition: str, count: int) -> None:
        if count < 0:
            raise InvalidRequestError(f"a rejected count must be >= 0, got {count}")
        self.create(partition, [])
        self.partitions[partition].rejected += count

    def evict(
        self, p: Partition, row_ids: list[int], effects: Effects, order: bool = True
    ) -> list[int]:
        """Delete committed rows for every task and (``order``) order their storage freed.
        Returns the ids of the rows deleted."""
        rows = p.rows
        removed = p.remove_rows(rows.committed_ids(row_ids))
        if not removed:
            return removed
        charges, holds = rows.on_units(removed)
        for u, nbytes in charges.items():
            self.units.bytes[u] -= nbytes
        if order:
            for u, ids in holds.items():
                effects.drop_rows.setdefault(u, {}).setdefault(p.name, []).extend(ids)
        gone = set(removed)
        for forget in self.on_evict:
            forget(p.name, gone)
        effects.room = True
        return removed

    def clear(self, name: str, effects: Effects) -> bool:
        """Partition ``name`` goes with its rows (False: there is none). Its units drop its
        chunks; the other owners let go of what names it (``ControllerState.clear_partition``)."""
        p = self.partitions.pop(name, None)
        if p is None:
            return False
        for u, nbytes in p.rows.on_units(p.rows.ids())[0].items():
            self.units.bytes[u] -= nbytes
        # A put to a re-created partition of this name can reach a unit before this order: scope
        # the drop to older chunks, and never reuse row ids under the name (see create).
        effects.drop_partitions.append((name, next(self.ids)))
        self.next_rows[name] = p.next_row
        effects.room = True
        return True

    def install(self, p: Partition) -> None:
        """Add partition ``p`` as a checkpoint saved it (its name free): its bytes count on the
        units holding its rows."""
        assert p.name not in self.partitions
        self.partitions[p.name] = p
        for u, nbytes in p.rows.on_units(p.rows.ids())[0].items():
            self.units.bytes[u] += nbytes

    def reserve_rows(self, next_rows: dict[str, int]) -> None:
        """Row ids below ``next_rows[name]`` were used under ``name``: never hand them out again."""
        for name, first in next_rows.items():
            self.next_rows[name] = max(self.next_rows.get(name, 0), first)

    def lose_unit(self, u: int, effects: Effects) -> None:
        """Unit ``u`` is gone: the rows it alone held are removed for every task, counted lost
        per partition and per task (a task that had acked a row does not count it)."""
        for p in list(self.partitions.values()):
            gone = p.rows.lose_unit(u)
            if not gone:
                continue
            for name in {*p.tasks, *p.registered}:
                t = p.tasks.task(name)
                t.lost += sum(1 for rid in gone if rid not in t.acked)
            removed = self.evict(p, gone, effects, order=False)
            p.lost += len(removed)
            self.units.lost_rows[u] += len(removed)
            if p.closed:  # parked gets may now learn that the partition is drained
                effects.touched.add(p.name)

    @staticmethod
    def rows(p: Partition, row_ids: list[int]) -> list[Row]:
        rows = [p.rows.get(r) for r in row_ids]
        missing = [
            rid for rid, r in zip(row_ids, rows, strict=True) if r is None or not r.committed
        ]
        if missing:
            raise UnknownRowError(
                f"{len(missing)} of {len(row_ids)} rows no longer exist in "
                f"partition {p.name!r} (cleared since the metadata was obtained)",
                partition=p.name,
                count=len(missing),
            )
        return rows  # type: ignore[return-value]

    @staticmethod
    def meta(
        p: Partition,
        ids: Sequence[int],
        fields: list[str],
        task: str | None = None,
        lease_id: int | None = None,
    ) -> BatchMeta:
        """The metadata of rows ``ids`` (in that order), read from the columns at once."""
        t = p.rows
        idx = t.index(ids)
        replicas = t.column(t.replica, idx)
        tags = [t.tags.get(rid) or {} for rid in ids] if t.tags else []
        return BatchMeta(
            partition=p.name,
            row_ids=list(ids),
            keys=p.keys_of(ids),
            units=t.column(t.unit, idx),
            groups=t.groups(idx),
            version_start=t.versions(t.vstart, idx),
            version_end=t.versions(t.vend, idx),
            fields=list(fields),
            schemas={f: p.schemas[f] for f in fields if f in p.schemas},
            task=task,
            lease_id=lease_id,
            dispatch_version=t.versions(t.vdisp, idx),
            replicas=replicas if max(replicas, default=-1) >= 0 else [],
            tags=tags if any(tags) else [],
            shapes=p.shapes.of(fields, ids) if p.shapes else {},
            generation=p.born,
        )

    @staticmethod
    def put_meta(p: Partition, ids: Sequence[int], fields: list[str]) -> BatchMeta | PackedMeta:
        """A new put's rows: packed when there are many and they are plain (see PackedMeta)."""
        t = p.rows
        if not isinstance(ids, range) or len(ids) <= SMALL or not t.plain(ids):
            return Catalog.meta(p, ids, fields)
        idx = t.index(ids)
        assert isinstance(idx, range)
        versions = [t.uniform(col, idx) for col in (t.vstart, t.vend, t.vdisp)]
        if not all(same for same, _ in versions):
            return Catalog.meta(p, ids, fields)
        replicas = t.runs(t.replica, idx)
        return PackedMeta(
            partition=p.name,
            first=ids.start,
            n=len(ids),
            key_prefix=p.key_prefix,
            units=t.runs(t.unit, idx),
            replicas=[] if replicas == [-1, len(ids)] else replicas,
            version_start=versions[0][1],
            version_end=versions[1][1],
            dispatch_version=versions[2][1],
            fields=list(fields),
            schemas={f: p.schemas[f] for f in fields if f in p.schemas},
            generation=p.born,
        )

    def expire_ttl(self, owner: Partition, row_ids: list[int], effects: Effects) -> None:
        """A partition's ttl for these rows ran out: evict those still there."""
        if self.partitions.get(owner.name) is owner:  # not cleared and re-created since
            owner.expired += len(self.evict(owner, row_ids, effects))
