"""Reads inside the controller state: gets served now or parked, lookups and listings.

A get is served from the partition's ready rows for its task (whole groups, within its staleness
window: rows that can never be in a window again are evicted when the get says ``on_stale="drop"``)
under a new lease (:mod:`.leases`), or parked until rows come — its partition is *touched*
(``Effects.touched``) by whatever may make rows ready, and the state then tries its parked gets
again. The parked gets are this module's: parked, served, timed out, failed with their partition
and forgotten with their peer here only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tqstream.controller.book import PutBook
from tqstream.controller.catalog import Catalog
from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.flow import Flow
from tqstream.controller.leases import Leases
from tqstream.controller.parked import Parked, ParkedGets
from tqstream.controller.partition import Partition
from tqstream.controller.peers import peer_of
from tqstream.controller.records import Effects
from tqstream.controller.rows import COMMITTED
from tqstream.controller.window import Window, check_window
from tqstream.errors import (
    InvalidRequestError,
    NotReadyError,
    PartitionClearedError,
    PartitionDrainedError,
    RequestTimeoutError,
    UnknownFieldError,
    UnknownRowError,
)
from tqstream.protocol.messages import GetMeta
from tqstream.types import BatchMeta, RowListing


class Gets:
    def __init__(
        self,
        catalog: Catalog,
        leases: Leases,
        book: PutBook,
        deadlines: DeadlineHeap,
        flow: Flow,
    ) -> None:
        self.catalog = catalog
        self.leases = leases  # a get served is leased
        self.parked = ParkedGets()  # owned here: parked and unparked by this class only
        self.book = book  # puts in flight: a closed partition is drained only once none is left
        self.deadlines = deadlines
        self.flow = flow  # stale rows dropped give their admission budget back

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
        window = Window.of(req)
        fresh = None if window is None else window.by_id(p.row)
        tasks = p.tasks
        rows = tasks.select(req.task, mask, req.batch_size, req.whole_groups, fresh)
        if rows is None and p.closed and not self._has_pending(p.name):
            rest = tasks.select_rest(req.task, mask, req.batch_size, req.whole_groups, fresh)
            rows = rest or None
            if rows is None and not tasks.may_serve_more(req.task, mask):
                outside = "" if fresh is None else " (rows outside the staleness window never are)"
                raise PartitionDrainedError(
                    f"partition {p.name!r} is closed and drained for task {req.task!r}: every "
                    f"row it could serve with fields {req.fields} was consumed{outside}",
                    partition=p.name,
                    task=req.task,
                )
        dropped = 0
        if p.tasks.stale_seen and req.on_stale == "drop":  # can never be in a window again: evict
            stale = p.tasks.stale_seen
            dropped = len(self.catalog.evict(p, stale, effects))
            p.stale_dropped += dropped
            p.tasks.task(req.task).stale_dropped += dropped
            self.flow.budget_back(p, dropped, effects)
        dropped = parked.dropped = parked.dropped + dropped
        if rows is None:
            return None
        lease_id = self.leases.grant(p, req, rows, peer_of(parked.handle), now)
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
        why = p.tasks.shortage(req.task, req.fields, req.batch_size, req.whole_groups)
        window = Window.of(req)
        if window is not None:
            mask = p.mask_of(req.fields)
            stale = sum(
                1
                for r in p.rows.values(COMMITTED)
                if (r.written & mask) == mask
                and p.tasks.available(r, req.task)
                and not window.admits(r)
            )
            why += (
                f"; {stale} of the ready rows are outside the staleness window "
                f"({window.describe()})"
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
            self.leases.reset(partition, name)
            n += p.tasks.reset(name)
        return n, Effects(touched={partition})

    def partition_cleared(self, partition: str, effects: Effects) -> None:
        """The gets parked on a cleared partition fail."""
        for parked in self.parked.drop_partition(partition):
            effects.failed.append((parked.handle, PartitionClearedError(
                f"partition {partition!r} was cleared while this get_meta waited",
                partition=partition,
            )))  # fmt: skip

    def drop_peer(self, peer: Any) -> None:
        """The reader ``peer`` went away: nobody waits for its parked gets."""
        self.parked.drop_peer(peer)

    def expire_parked(self, parked: Parked, effects: Effects) -> None:
        """A parked get's timeout came: it fails with what it waited for."""
        if self.parked.unpark(parked):
            p = self.catalog.partitions[parked.req.partition]
            effects.failed.append((parked.handle, self.timeout_error(p, parked.req)))
