"""The controller's partitions by name: created, closed, looked up, their rows evicted.

A :class:`Catalog` owns the partitions (each :class:`~tqstream.controller.partition.Partition`
owns its rows) and the first row id a re-created partition of a name starts at, so that row ids
are never reused under a name. Evicting rows removes them for every task, uncounts their bytes on
their units, forgets them in the leases that held them, and orders their storage freed.
"""

from __future__ import annotations

import secrets

from tqstream.controller.partition import Partition, Row
from tqstream.controller.records import Effects, Ids, LeaseTable
from tqstream.controller.units import UnitTable
from tqstream.errors import InvalidRequestError, UnknownPartitionError, UnknownRowError
from tqstream.types import BatchMeta


class Catalog:
    def __init__(self, units: UnitTable, leases: LeaseTable, ids: Ids, replicas: int) -> None:
        self.units = units
        self.leases = leases
        self.ids = ids
        self.replicas = replicas  # copies of each row, for partitions that do not say
        self.partitions: dict[str, Partition] = {}
        self.next_rows: dict[str, int] = {}  # first row id of a re-created partition

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
            p = self.partitions[name] = Partition(name, f"{secrets.token_hex(4)}-")
            p.next_row = self.next_rows.get(name, 0)
            p.born = next(self.ids)  # leases with smaller ids belong to an earlier incarnation
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
    ) -> list[Row]:
        """Delete committed rows for every task and (``order``) order their storage freed."""
        rows = p.rows
        removed = p.remove_rows([r for r in row_ids if r in rows and rows[r].committed])
        drops: dict[int, list[int]] = {}
        for r in removed:
            self.units.charge(r.unit, r.replica, -r.nbytes)
            if order:
                for u in (r.unit, r.replica):
                    if u >= 0:
                        drops.setdefault(u, []).append(r.id)
        for u, ids in drops.items():
            effects.drop_rows.setdefault(u, {}).setdefault(p.name, []).extend(ids)
        if removed:
            self.leases.forget_rows(p.name, {r.id for r in removed})
            effects.room = True
        return removed

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
        rows: list[Row],
        fields: list[str],
        task: str | None = None,
        lease_id: int | None = None,
    ) -> BatchMeta:
        return BatchMeta(
            partition=p.name,
            row_ids=[r.id for r in rows],
            keys=[p.key_of(r) for r in rows],
            units=[r.unit for r in rows],
            groups=[r.group for r in rows],
            version_start=[r.version_start for r in rows],
            version_end=[r.version_end for r in rows],
            fields=list(fields),
            schemas={f: p.schemas[f] for f in fields if f in p.schemas},
            task=task,
            lease_id=lease_id,
            dispatch_version=[r.dispatch_version for r in rows],
            replicas=[r.replica for r in rows] if any(r.replica >= 0 for r in rows) else [],
            tags=[r.tags or {} for r in rows] if any(r.tags for r in rows) else [],
        )

    def expire_ttl(self, owner: Partition, row_ids: list[int], effects: Effects) -> None:
        """A partition's ttl for these rows ran out: evict those still there."""
        if self.partitions.get(owner.name) is owner:  # not cleared and re-created since
            owner.expired += len(self.evict(owner, row_ids, effects))
