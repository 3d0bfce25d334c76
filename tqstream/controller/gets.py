"""Reads inside the controller state: gets (served now or parked), leases, acks, releases.

A get is served from the partition's ready rows for its task (whole groups, within its staleness
window: rows that can never be in a window again are evicted when the get says ``on_stale="drop"``)
under a new lease, or parked until rows come — its partition is *touched* (``Effects.touched``) by
whatever may make rows ready, and the state then tries its parked gets again. Acks end rows for a
task (a row every registered task acked is freed); releases, expired leases and resets give rows
back.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import msgspec

from tqstream.controller.book import PutBook
from tqstream.controller.catalog import Catalog
from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.flow import Flow
from tqstream.controller.leases import Lease, LeaseTable
from tqstream.controller.parked import Parked, ParkedGets
from tqstream.controller.partition import Partition
from tqstream.controller.peers import peer_of
from tqstream.controller.records import Effects, Ids
from tqstream.controller.rows import COMMITTED
from tqstream.controller.window import check_window, version_of
from tqstream.errors import (
    InvalidRequestError,
    LeaseError,
    LeaseExpiredError,
    NotReadyError,
    PartitionDrainedError,
    RequestTimeoutError,
    UnknownFieldError,
    UnknownLeaseError,
    UnknownRowError,
)
from tqstream.protocol.messages import GetMeta
from tqstream.types import BatchMeta, RowListing


class Gets:
    def __init__(
        self,
        catalog: Catalog,
        leases: LeaseTable,
        parked: ParkedGets,
        book: PutBook,
        deadlines: DeadlineHeap,
        flow: Flow,
        ids: Ids,
        lease_timeout: float,
    ) -> None:
        self.catalog = catalog
        self.leases = leases
        self.parked = parked
        self.book = book  # puts in flight: a closed partition is drained only once none is left
        self.deadlines = deadlines
        self.flow = flow  # stale rows dropped give their admission budget back
        self.ids = ids
        self.lease_timeout = lease_timeout

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
        p = self.catalog.partition(req.partition)
        mask = p.mask_of(req.fields)
        parked = Parked(handle, req, mask)
        effects = Effects()
        meta = self._try_serve(p, req, mask, now, parked, effects)
        if meta is None and req.timeout == 0:
            effects.failed.append((handle, self.timeout_error(p, req)))
        elif meta is None:
            self.parked.park(parked)
            if req.timeout is not None:
                self.deadlines.add(now + req.timeout, "park", parked)
        return meta, effects

    def _try_serve(
        self, p: Partition, req: GetMeta, mask: int, now: float, parked: Parked, effects: Effects
    ) -> BatchMeta | None:
        fresh = None
        if req.max_staleness is not None and req.current_version is not None:
            oldest = req.current_version - req.max_staleness
            measure = req.measure

            def fresh(rid: int) -> bool:
                v = version_of(p.row(rid), measure)
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
            dropped = len(self.catalog.evict(p, stale, effects))
            p.stale_dropped += dropped
            p.task(req.task).stale_dropped += dropped
            self.flow.budget_back(p, dropped, effects)
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
        self.deadlines.add(lease.deadline, "lease", lease_id)
        meta = self.catalog.meta(p, rows, req.fields, req.task, lease_id)
        if req.measure == "token":  # the client masks the tokens outside (fresh_mask)
            bounds = [] if req.max_staleness is None else [req.current_version, req.max_staleness]
            meta = msgspec.structs.replace(meta, token_window=bounds)
        return msgspec.structs.replace(meta, stale_dropped=dropped) if dropped else meta

    def _has_pending(self, partition: str) -> bool:
        return bool(self.book.where(partition=partition, live=True))

    def serve_parked(self, partition: str, effects: Effects, now: float) -> None:
        waiting = self.parked.of(partition)
        p = self.catalog.partitions.get(partition)
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

    def timeout_error(self, p: Partition, req: GetMeta) -> RequestTimeoutError:
        why = p.shortage(req.task, req.fields, req.batch_size, req.whole_groups)
        if req.max_staleness is not None and req.current_version is not None:
            oldest, mask = req.current_version - req.max_staleness, p.mask_of(req.fields)
            stale = sum(
                1
                for r in p.rows.values(COMMITTED)
                if (r.written & mask) == mask
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
        p = self.catalog.partitions.get(partition)
        if p is None and missing_ok:
            return BatchMeta(partition, [], [], [], [], [], [], [], {})
        p = self.catalog.partition(partition)
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
        return self.catalog.meta(p, [r.id for r in rows], fields)

    def list_keys(self, partition: str) -> list[str]:
        p = self.catalog.partition(partition)
        return p.keys_of(p.rows.ids(COMMITTED))

    def list_rows(
        self, partition: str | None, fields: list[str], task: str | None
    ) -> dict[str, RowListing]:
        """Every committed row of ``partition`` (None: of every partition), in put order, with
        whether ``fields`` are written and ``task`` consumed it. A scan: O(rows)."""
        names = [partition] if partition is not None else list(self.catalog.partitions)
        out = {}
        for name in names:
            p = self.catalog.partition(name)
            mask = p.mask_of(fields) if partition is not None else self._known_mask(p, fields)
            rows = list(p.rows.values(COMMITTED))
            t = p.tasks.get(task) if task is not None else None
            out[name] = RowListing(
                meta=self.catalog.meta(p, [r.id for r in rows], fields if mask >= 0 else []),
                ready=[mask >= 0 and (r.written & mask) == mask for r in rows],
                consumed=[t is not None and (r.id in t.leased or t.is_acked(r.id)) for r in rows],
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
        p = self.catalog.partition(partition)
        tasks = [task] if task is not None else list(p.tasks)
        n = 0
        for name in tasks:
            for lease in self.leases.where(partition=partition, task=name):
                self.leases.end(lease, "reset")
            n += p.reset(name)
        return n, Effects(touched={partition})

    def ack(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], tokens_masked: int = 0,
        resumed: bool = False,
    ) -> tuple[int, Effects]:  # fmt: skip
        effects = Effects()
        lease, p = self._lease_for(partition, task, lease_id, row_ids, resumed)
        if lease is None or p is None:
            return 0, effects
        rows = [r for r in row_ids if r in lease.rows]
        n = p.ack(task, rows)
        if n:
            p.task(task).tokens_masked += tokens_masked
        lease.rows.difference_update(rows)
        if lease.rows and rows:  # a partial ack: remembered, so that repeating it stays harmless
            lease.acked = set(rows) if lease.acked is None else lease.acked | set(rows)
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
                p.freed += len(self.catalog.evict(p, done, effects))
        return n, effects

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
        return n, effects

    def _lease_for(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], resumed: bool = False
    ) -> tuple[Lease | None, Partition | None]:
        """The active lease, or None when the call is a harmless repeat; raises otherwise.
        ``resumed``: the ack of a batch a checkpoint trained on, whose lease may have ended
        since (the trainer died): see :meth:`_reclaim`."""
        p = self.catalog.partitions.get(partition)
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
        before = self.leases.acked_before_end(lease_id)
        if status in ("disconnected", "expired") and before.issuperset(row_ids):
            return None, None  # a repeat of an ack this lease made before it ended
        if resumed and status in ("disconnected", "expired"):
            return self._reclaim(p, task, lease_id, row_ids, before), p
        unacked = len(set(row_ids) - before)
        if status == "disconnected":  # whatever became of its rows: the batch went elsewhere
            raise LeaseExpiredError(
                f"lease {lease_id} of task {task!r} was given up when the connection that took it "
                f"dropped (the client died, or missed heartbeats for 3 intervals): its {unacked} "
                f"unacked rows went back to available and may have been delivered to another "
                f"reader",
                lease_id=lease_id,
            )
        if status == "expired":
            raise LeaseExpiredError(
                f"lease {lease_id} of task {task!r} expired (lease_timeout) before this call: its "
                f"{unacked} unacked rows went back to available and may have been delivered to "
                f"another reader; ack sooner or pass a longer lease_timeout to get_meta",
                lease_id=lease_id,
            )
        if lease is not None and lease.rows.issuperset(row_ids):
            return lease, p
        t = p.tasks.get(task)
        acked: Set[int] = t.acked if t is not None else set()
        live = [r for r in row_ids if r in p.rows]
        outside = [r for r in live if r not in acked and (lease is None or r not in lease.rows)]
        if not outside:  # a repeat of an ack that succeeded (the lease ended "acked")
            return lease, p
        raise LeaseError(
            f"{len(outside)} rows are not leased under lease {lease_id} of task "
            f"{task!r} (released earlier, or never part of it)",
            lease_id=lease_id,
        )

    def _reclaim(
        self, p: Partition, task: str, lease_id: int, row_ids: list[int], before: frozenset[int]
    ) -> Lease | None:
        """A new lease over the rows of an ended lease that no one took since (available to
        ``task``), for the ack of a checkpoint's batch: the run that survives trained on them.
        Rows another reader leased or acked meanwhile were trained on twice: an error."""
        t = p.tasks.get(task)
        leased = {} if t is None else t.leased
        live = [r for r in dict.fromkeys(row_ids) if r in p.rows and r not in before]
        gone = [r for r in live if r in leased or (t is not None and t.is_acked(r))]
        if gone:
            raise LeaseExpiredError(
                f"lease {lease_id} of task {task!r} ended before the resumed run acked it, and "
                f"{len(gone)} of its rows went to another reader meanwhile (they were trained on "
                f"twice); restart within lease_timeout, or pass a longer one to get_meta",
                lease_id=lease_id,
                rows=len(gone),
            )
        if not live:
            return None
        claim = next(self.ids)
        p.lease(task, live, claim)
        lease = Lease(claim, p.name, task, set(live), 0.0)
        self.leases.grant(lease)  # acked at once by the caller, on behalf of the ended lease:
        self.leases.acked_after_end(lease_id, live)  # repeating this ack is harmless
        return lease

    # --- deadlines ---
    def expire_lease(self, lease_id: int, deadline: float) -> str | None:
        """A lease's deadline came: its rows not acked go back to available. Returns its
        partition (whose parked gets may be served now), None when the lease ended before."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.deadline != deadline:
            return None
        self.catalog.partitions[lease.partition].release(lease.task, sorted(lease.rows))
        self.leases.end(lease, "expired")
        return lease.partition

    def expire_parked(self, parked: Parked, effects: Effects) -> None:
        """A parked get's timeout came: it fails with what it waited for."""
        if self.parked.unpark(parked):
            p = self.catalog.partitions[parked.req.partition]
            effects.failed.append((parked.handle, self.timeout_error(p, parked.req)))
