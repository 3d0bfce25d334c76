"""The controller's whole state, pure: no sockets, no clock (``now`` is an argument).

The service calls one method per request and turns the returned :class:`Effects` into I/O: replies
to parked requests, errors for timed-out ones, and drop orders for storage units. Every deadline
(lease expiry, uncommitted put, parked request timeout) sits in one heap; the service keeps a
single timer at :meth:`ControllerState.next_deadline` and calls :meth:`expire` when it fires, so
nothing polls.

Puts (:mod:`~tqstream.controller.puts`), flow control (:mod:`~tqstream.controller.flow`), the
handling of lost units and disconnected peers (:mod:`~tqstream.controller.faults`) and the deadline
heap (:mod:`~tqstream.controller.deadlines`) are mixins over the same state, one concept per file;
this module holds partitions, gets, consumption, clearing and stats.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any

import msgspec

from tqstream.controller.budget import Budgets
from tqstream.controller.deadlines import DeadlineHeap, Deadlines
from tqstream.controller.faults import Faults
from tqstream.controller.flow import FlowControl
from tqstream.controller.partition import Partition, Row
from tqstream.controller.peers import peer_of
from tqstream.controller.puts import Puts
from tqstream.controller.records import (
    AdmissionTable,
    Effects,
    Lease,
    LeaseTable,
    Parked,
    ParkedGets,
    PutBook,
    check_window,
    version_of,
)
from tqstream.controller.units import UnitTable
from tqstream.errors import (
    InvalidRequestError,
    LeaseError,
    LeaseExpiredError,
    NotReadyError,
    PartitionClearedError,
    PartitionClosedError,
    PartitionDrainedError,
    RequestTimeoutError,
    UnknownFieldError,
    UnknownLeaseError,
    UnknownPartitionError,
    UnknownRowError,
)
from tqstream.protocol.messages import (
    GetMeta,
)
from tqstream.types import BatchMeta, PartitionStats, RowListing


class ControllerState(Puts, FlowControl, Faults, Deadlines):
    def __init__(
        self,
        *,
        lease_timeout: float = 300.0,
        put_timeout: float = 60.0,
        replicas: int = 1,
        max_rows: int = 0,
    ) -> None:
        self.lease_timeout = lease_timeout
        self.put_timeout = put_timeout
        self.replicas = replicas  # copies of each row, for partitions that do not say
        self.max_rows = max_rows  # rows held at most, over every partition; 0: no cap
        self.partitions: dict[str, Partition] = {}
        self.units = UnitTable()
        self.now = 0.0  # the latest time seen: a put woken by freed bytes is planned at it
        self.admissions = AdmissionTable()
        self.budgets = Budgets()  # StalenessManagers' pooled budgets
        self.puts = PutBook()
        self.leases = LeaseTable()
        self.parked = ParkedGets()
        self.deadlines = DeadlineHeap(self._live)
        self.ids = itertools.count(1)  # put, lease, chunk and partition-incarnation ids
        self.next_rows: dict[str, int] = {}  # first row id of a re-created partition

    def settle(self, effects: Effects, now: float) -> Effects:
        """Carry out the signals between the parts of the state that ``effects`` holds — serve
        the parked gets of touched partitions, retry the puts waiting for room once some was
        freed, grant woken acquires — until none is left (each may raise more), and return the
        effects for the service."""
        while effects.touched or effects.room or effects.woken:
            if effects.woken:
                names, effects.woken = effects.woken, set()
                for name in sorted(names):
                    if name in self.admissions:
                        self._wake_acquires(name, effects)
            elif effects.room:
                effects.room = False
                self._serve_parked_puts(effects)
            else:
                name = min(effects.touched)
                effects.touched.discard(name)
                self._serve_parked(name, effects, now)
        return effects

    # --- units and partitions ---
    def add_unit(self, address: str, max_bytes: int = 0) -> tuple[int, Effects]:
        """Register a storage unit; a lost one registering again revives (empty) — see
        :meth:`~tqstream.controller.faults.Faults.revive_unit`."""
        u, lost = self.units.add(address, max_bytes)
        return u, self.revive_unit(u) if lost else Effects()

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

    def create_partition(
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

    def close_partition(self, name: str, now: float) -> tuple[int, Effects]:
        """One producer is done. Returns the producers still open (0: closed) and the effects:
        parked gets that can now only get a short last batch, or the end of the stream."""
        p = self.partition(name)
        p.closes += 1
        effects = Effects()
        if p.closed:
            effects.touched.add(name)
        return max(p.producers - p.closes, 0), self.settle(effects, now)

    # --- gets ---
    def get_meta(self, req: GetMeta, handle: Any, now: float) -> tuple[BatchMeta | None, Effects]:
        """Serve now, or park ``handle`` (answered later through ``Effects``) and return None.
        A get that cannot wait (``timeout=0``) and finds no rows fails through the effects too:
        the attempt may have evicted stale rows, whose drop orders go out with the failure."""
        if req.batch_size <= 0:
            raise InvalidRequestError(
                f"batch_size must be a positive number of rows, got {req.batch_size}",
                batch_size=req.batch_size,
            )
        if not req.fields:
            raise InvalidRequestError("get_meta needs at least one field to wait for")
        if not req.task:
            raise InvalidRequestError("get_meta needs a task name (e.g. task='actor')")
        if req.timeout is not None and req.timeout < 0:
            raise InvalidRequestError(f"timeout must be >= 0 or None, got {req.timeout}")
        if req.lease_timeout is not None and req.lease_timeout <= 0:
            raise InvalidRequestError(f"lease_timeout must be > 0, got {req.lease_timeout}")
        check_window(req)
        p = self.partition(req.partition)
        mask = p.mask_of(req.fields)
        parked = Parked(handle, req, mask)
        effects = Effects()
        meta = self._try_serve(p, req, mask, now, parked, effects)
        if meta is None and req.timeout == 0:
            effects.failed.append((handle, self._timeout_error(p, req)))
        elif meta is None:
            self.parked.park(parked)
            if req.timeout is not None:
                self.schedule(now + req.timeout, "park", parked)
        return meta, self.settle(effects, now)

    def _try_serve(
        self, p: Partition, req: GetMeta, mask: int, now: float, parked: Parked, effects: Effects
    ) -> BatchMeta | None:
        fresh = None
        if req.max_staleness is not None and req.current_version is not None:
            oldest = req.current_version - req.max_staleness
            measure = req.measure

            def fresh(r: Row) -> bool:
                v = version_of(r, measure)
                return v is None or v >= oldest

        rows = p.select(req.task, mask, req.batch_size, req.whole_groups, fresh)
        if rows is None and p.closed and not self._has_pending(p.name):
            rows = p.select_rest(req.task, mask, req.batch_size, req.whole_groups, fresh) or None
            if rows is None and not p.may_serve_more(req.task, mask):
                window = "" if fresh is None else " (rows outside the staleness window never are)"
                raise PartitionDrainedError(
                    f"partition {p.name!r} is closed and drained for task {req.task!r}: every "
                    f"row it could serve with fields {req.fields} was consumed{window}",
                    partition=p.name,
                    task=req.task,
                )
        dropped = 0
        if p.stale_seen and req.on_stale == "drop":  # can never be in a window again: evict
            stale = p.stale_seen
            dropped = len(self._evict(p, stale, effects))
            p.stale_dropped += dropped
            p.task(req.task).stale_dropped += dropped
            self._budget_back(p, dropped, effects)
        dropped = parked.dropped = parked.dropped + dropped
        if rows is None:
            return None
        lease_id = next(self.ids)
        p.lease(req.task, rows, lease_id)
        lease = Lease(
            lease_id,
            p.name,
            req.task,
            set(rows),
            now + (req.lease_timeout or self.lease_timeout),
            req.current_version,
            req.measure,
            peer_of(parked.handle),
        )
        self.leases.grant(lease)
        self.schedule(lease.deadline, "lease", lease_id)
        meta = self._meta(p, [p.rows[r] for r in rows], req.fields, req.task, lease_id)
        if req.measure == "token":  # the client masks the tokens outside (fresh_mask)
            bounds = [] if req.max_staleness is None else [req.current_version, req.max_staleness]
            meta = msgspec.structs.replace(meta, token_window=bounds)
        return msgspec.structs.replace(meta, stale_dropped=dropped) if dropped else meta

    def _has_pending(self, partition: str) -> bool:
        return bool(self.puts.where(partition=partition, live=True))

    def _serve_parked(self, partition: str, effects: Effects, now: float) -> None:
        waiting = self.parked.of(partition)
        p = self.partitions.get(partition)
        if not waiting or p is None:
            return
        for parked in waiting:
            try:
                meta = self._try_serve(p, parked.req, parked.mask, now, parked, effects)
            except PartitionDrainedError as e:
                self.parked.unpark(parked)
                effects.failed.append((parked.handle, e))
                continue
            if meta is not None:
                self.parked.unpark(parked)
                effects.served.append((parked.handle, meta))

    def _timeout_error(self, p: Partition, req: GetMeta) -> RequestTimeoutError:
        why = p.shortage(req.task, req.fields, req.batch_size, req.whole_groups)
        if req.max_staleness is not None and req.current_version is not None:
            oldest, mask = req.current_version - req.max_staleness, p.mask_of(req.fields)
            stale = sum(
                1
                for r in p.rows.values()
                if r.committed
                and (r.written & mask) == mask
                and p.available(r, req.task)
                and (v := version_of(r, req.measure)) is not None
                and v < oldest
            )
            why += (
                f"; {stale} of the ready rows are outside the staleness window ({req.measure} "
                f"version < {oldest} = current_version {req.current_version} - max_staleness "
                f"{req.max_staleness})"
            )
        return RequestTimeoutError(
            f"get_meta(partition={req.partition!r}, task={req.task!r}, fields={req.fields}, "
            f"batch_size={req.batch_size}) timed out after {req.timeout}s: {why}",
            partition=req.partition,
            task=req.task,
        )

    def cancel_parked(self, handle: Any) -> None:
        """The requester went away: forget its parked request."""
        self.parked.cancel(handle)

    def get_by_keys(
        self,
        partition: str,
        keys: list[str],
        fields: list[str] | None,
        row_ids: list[int] | None = None,
        missing_ok: bool = False,
    ) -> BatchMeta:
        """The rows of ``keys`` (or, without keys, of ``row_ids``) in that order, with ``fields``
        (None: the fields they all have). Rows that do not exist raise, or with ``missing_ok``
        are left out (and a partition that does not exist gives an empty batch)."""
        p = self.partitions.get(partition)
        if p is None and missing_ok:
            return BatchMeta(partition, [], [], [], [], [], [], [], {})
        p = self.partition(partition)
        if keys or not row_ids:
            found = [p.row_of_key(k) for k in keys]
            named: list[Any] = keys
        else:
            found = [p.rows.get(rid) for rid in row_ids]
            named = row_ids
        missing = [n for n, r in zip(named, found, strict=True) if r is None or not r.committed]
        if missing and not missing_ok:
            if named is keys:
                raise p.unknown_keys(missing, len(keys))
            raise UnknownRowError(
                f"{len(missing)} of {len(named)} rows of partition {partition!r} do not exist "
                f"(row ids {missing[:5]}): cleared since the metadata was obtained, or never put",
                partition=partition,
                count=len(missing),
            )
        rows = [r for r in found if r is not None and r.committed]
        if fields is None:
            fields = p.common_fields(rows)
        p.mask_of(fields)  # unknown fields raise
        for f in fields:
            lacking = [p.key_of(r) for r in rows if not r.written & p.bits[f]]
            if lacking:
                raise NotReadyError(
                    f"field {f!r} is not written for {len(lacking)} of the "
                    f"requested rows of partition {partition!r} (e.g. key "
                    f"{lacking[0]!r})",
                    field=f,
                    rows=len(lacking),
                )
        return self._meta(p, rows, fields)

    def list_keys(self, partition: str) -> list[str]:
        p = self.partition(partition)
        return [p.key_of(r) for r in p.rows.values() if r.committed]

    def upsert_rows(
        self,
        partition: str,
        keys: list[str],
        tags: list[Any] | None,
        create: bool,
        row_ids: list[int] | None = None,
    ) -> BatchMeta:
        """Merge ``tags`` into the rows of ``keys``; with ``create``, keys that do not exist become
        rows without fields, placed on a unit like a put's rows (their fields, written later, go
        there). Without keys, the rows are ``row_ids`` (which must exist). Returns the rows'
        metadata with the fields they all have. Nothing changes on error."""
        if not keys and row_ids:
            named = self.partition(partition)
            found = self._rows(named, row_ids)
            if tags is not None and len(tags) != len(found):
                raise InvalidRequestError(
                    f"tags= has {len(tags)} entries but {len(found)} rows were named"
                )
            for r, t in zip(found, tags or [], strict=False):
                r.merge_tags(t)
            return self._meta(named, found, named.common_fields(found))
        if tags is not None and len(tags) != len(keys):
            raise InvalidRequestError(
                f"tags= has {len(tags)} entries but {len(keys)} keys were given"
            )
        if len(set(keys)) < len(keys):
            twice = next(k for i, k in enumerate(keys) if k in keys[:i])
            raise InvalidRequestError(f"key {twice!r} is named more than once", key=twice)
        p = self.partitions.get(partition)
        if p is None and not create:
            p = self.partition(partition)  # raises
        old, new_keys = self._rows_by_key(p or Partition(partition, ""), keys, create)
        self._check_rows(partition, len(new_keys))
        runs = self._place_new(partition, len(new_keys))
        if p is None:
            self.create_partition(partition, [])
            p = self.partitions[partition]
        elif new_keys and p.closed:
            raise PartitionClosedError(
                f"partition {partition!r} is closed: it takes no new rows ({len(new_keys)} keys "
                f"do not exist in it)",
                partition=partition,
            )
        created = p.reserve_rows(len(new_keys), new_keys, None, None, None, frozenset())
        for unit, replica, start, stop in runs:
            for r in created[start:stop]:
                r.unit, r.replica = unit, replica
        p.commit_rows(created, 0)
        p.produced += len(created)
        if created and p.ttl is not None:
            self.schedule(self.now + p.ttl, "ttl", (p, [r.id for r in created]))
        fresh = iter(created)
        rows = [next(fresh) if r is None else r for r in old]
        if tags is not None:
            for r, t in zip(rows, tags, strict=True):
                r.merge_tags(t)
        return self._meta(p, rows, p.common_fields(rows))

    def list_rows(
        self, partition: str | None, fields: list[str], task: str | None
    ) -> dict[str, RowListing]:
        """Every committed row of ``partition`` (None: of every partition), in put order, with
        whether ``fields`` are written and ``task`` consumed it. A scan: O(rows)."""
        names = [partition] if partition is not None else list(self.partitions)
        out = {}
        for name in names:
            p = self.partition(name)
            mask = p.mask_of(fields) if partition is not None else self._known_mask(p, fields)
            rows = [r for r in p.rows.values() if r.committed]
            t = p.tasks.get(task) if task is not None else None
            out[name] = RowListing(
                meta=self._meta(p, rows, fields if mask >= 0 else []),
                ready=[mask >= 0 and (r.written & mask) == mask for r in rows],
                consumed=[t is not None and (r.id in t.leased or r.id in t.acked) for r in rows],
            )
        return out

    @staticmethod
    def _known_mask(p: Partition, fields: list[str]) -> int:
        """The mask of ``fields``, or -1 when ``p`` lacks one (listing every partition)."""
        try:
            return p.mask_of(fields)
        except UnknownFieldError:
            return -1

    def reset_consumption(
        self, partition: str, task: str | None, now: float
    ) -> tuple[int, Effects]:
        """Make every row ``task`` (None: every task) leased or acked available to it again;
        its leases end (acking them later does nothing). Returns the rows given back."""
        p = self.partition(partition)
        tasks = [task] if task is not None else list(p.tasks)
        n = 0
        for name in tasks:
            for lease in self.leases.where(partition=partition, task=name):
                self.leases.end(lease, "reset")
            n += p.reset(name)
        return n, self.settle(Effects(touched={partition}), now)

    # --- consumption ---
    def ack(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], tokens_masked: int = 0
    ) -> tuple[int, Effects]:
        effects = Effects()
        lease, p = self._lease_for(partition, task, lease_id, row_ids)
        if lease is None or p is None:
            return 0, effects
        rows = [r for r in row_ids if r in lease.rows]
        n = p.ack(task, rows)
        if n:
            p.task(task).tokens_masked += tokens_masked
        lease.rows.difference_update(rows)
        if lease.current_version is not None:
            hist = p.task(task).lag
            for rid in rows:
                v = version_of(p.rows[rid], lease.measure)
                if v is not None:
                    lag = lease.current_version - v
                    hist[lag] = hist.get(lag, 0) + 1
        if not lease.rows:
            self.leases.end(lease, "acked")
        if p.closed:  # the last rows of a closed partition acked: parked gets learn it drained
            effects.touched.add(partition)
        if p.registered and task in p.registered:  # free rows every registered task consumed
            others = [p.tasks.get(t) for t in p.registered if t != task]
            if all(t is not None for t in others):
                acked = [t.acked for t in others]  # type: ignore[union-attr]
                done = [r for r in rows if all(r in a for a in acked)] if acked else rows
                p.freed += len(self._evict(p, done, effects))
        return n, self.settle(effects, self.now)

    def release(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], now: float
    ) -> tuple[int, Effects]:
        effects = Effects()
        lease, p = self._lease_for(partition, task, lease_id, row_ids)
        if lease is None or p is None:
            return 0, effects
        rows = [r for r in row_ids if r in lease.rows]
        n = p.release(task, rows)
        lease.rows.difference_update(rows)
        if not lease.rows:
            self.leases.end(lease, "released")
        effects.touched.add(partition)
        return n, self.settle(effects, now)

    def _lease_for(
        self, partition: str, task: str, lease_id: int, row_ids: list[int]
    ) -> tuple[Lease | None, Partition | None]:
        """The active lease, or None when the call is a harmless repeat; raises otherwise."""
        p = self.partitions.get(partition)
        lease = self.leases.get(lease_id)
        if lease is not None and (lease.task != task or lease.partition != partition):
            raise UnknownLeaseError(
                f"lease {lease_id} belongs to task {lease.task!r} of partition "
                f"{lease.partition!r}, not to task {task!r} of {partition!r}",
                lease_id=lease_id,
            )
        status = self.leases.status(lease_id)
        if status is None:
            raise UnknownLeaseError(
                f"lease {lease_id} is unknown to this controller (never granted, or granted by a "
                f"controller that has since restarted); get the rows again with get_meta",
                lease_id=lease_id,
            )
        if p is None or status in ("cleared", "reset") or lease_id < p.born:
            return None, None
        if lease is not None and lease.rows.issuperset(row_ids):
            return lease, p
        t = p.tasks.get(task)
        acked = t.acked if t is not None else set()
        live = [r for r in row_ids if r in p.rows]
        outside = [r for r in live if r not in acked and (lease is None or r not in lease.rows)]
        if not outside:
            return lease, p
        if status == "disconnected":
            raise LeaseExpiredError(
                f"lease {lease_id} of task {task!r} was given up when the connection that took it "
                f"dropped (the client died, or missed heartbeats for 3 intervals): its "
                f"{len(outside)} unacked rows went back to available and may be delivered again",
                lease_id=lease_id,
            )
        if status == "expired":
            raise LeaseExpiredError(
                f"lease {lease_id} of task {task!r} expired (lease_timeout) before this call: its "
                f"{len(outside)} unacked rows went back to available and may be delivered again; "
                f"ack sooner or pass a longer lease_timeout to get_meta",
                lease_id=lease_id,
            )
        raise LeaseError(
            f"{len(outside)} rows are not leased under lease {lease_id} of task "
            f"{task!r} (released earlier, or never part of it)",
            lease_id=lease_id,
        )

    # --- clearing ---
    def clear_samples(self, partition: str, row_ids: list[int]) -> Effects:
        effects = Effects()
        self._evict(self.partition(partition), row_ids, effects)
        return self.settle(effects, self.now)

    def _evict(
        self, p: Partition, row_ids: list[int], effects: Effects, order: bool = True
    ) -> list[Row]:
        """Delete committed rows for every task and (``order``) order their storage freed."""
        rows = p.rows
        removed = p.remove_rows([r for r in row_ids if r in rows and rows[r].committed])
        drops: dict[int, list[int]] = {}
        for r in removed:
            self._charge(r, -r.nbytes)
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

    def count_rejected(self, partition: str, count: int) -> None:
        if count < 0:
            raise InvalidRequestError(f"a rejected count must be >= 0, got {count}")
        self.create_partition(partition, [])
        self.partitions[partition].rejected += count

    def clear_partition(self, partition: str) -> Effects:
        """Make sure ``partition`` is gone: clearing one that does not exist does nothing."""
        effects = Effects()
        p = self.partitions.get(partition)
        if p is None:
            return effects
        for r in p.rows.values():
            self._charge(r, -r.nbytes)
        # A put to a re-created partition of this name can reach a unit before this order: scope
        # the drop to older chunks, and never reuse row ids under the name (see create_partition).
        effects.drop_partitions.append((partition, next(self.ids)))
        self.next_rows[partition] = p.next_row
        for put in self.puts.where(partition=partition):
            put.cancelled = True  # commit or deadline still drops its chunks
        for lease in self.leases.where(partition=partition):
            self.leases.end(lease, "cleared")
        for parked in self.parked.drop_partition(partition):
            effects.failed.append(
                (
                    parked.handle,
                    PartitionClearedError(
                        f"partition {partition!r} was cleared while this get_meta waited",
                        partition=partition,
                    ),
                )
            )
        del self.partitions[partition]
        effects.room = True
        return self.settle(effects, self.now)

    # --- helpers ---
    @staticmethod
    def _rows(p: Partition, row_ids: list[int]) -> list[Row]:
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
    def _meta(
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

    def stats(self, partition: str | None) -> dict[str, PartitionStats]:
        names = [partition] if partition is not None else sorted(self.partitions)
        out = {}
        for name in names:
            p = self.partition(name)
            out[name] = PartitionStats(
                rows=p.committed,
                fields={f: p.written_count.get(f, 0) for f in p.bits},
                schemas=dict(p.schemas),
                tasks=p.task_stats(),
                pending_puts=len(self.puts.where(partition=name, live=True)),
                parked_requests=self.parked.count(name),
                produced=p.produced,
                rejected=p.rejected,
                stale_dropped=p.stale_dropped,
                expired=p.expired,
                freed=p.freed,
                tasks_registered=list(p.registered),
                producers_open=max(p.producers - p.closes, 0),
                lost=p.lost,
                replicas=self.replicas_of(name),
            )
        return out
