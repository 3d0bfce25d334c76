"""Writes inside the controller state: plan, commit, abort.

A put is two-phase: ``prepare_put`` validates everything, reserves keys, group slots and row ids
and places the rows on storage units (and each run's replica on another unit when the partition
keeps two copies); the client stores the chunks; ``commit`` makes the rows visible at once.
``abort`` (or the put deadline, or the loss of a unit it stored on, or its producer's disconnect)
removes the reservation and orders the units to drop whatever chunks arrived, so a failed put
leaves neither rows nor bytes.

Puts that do not fit the units' byte quotas wait (``PutBook``'s waiting puts) and are retried, in
arrival order, whenever room is freed (``Effects.room``). The put book is this module's: a put
opens, ends and waits here only; the checks of a request are :mod:`.checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from tqstream.controller.book import Half, PendingPut, PutBook, WaitingPut
from tqstream.controller.catalog import Catalog
from tqstream.controller.checks import (
    capacity_error,
    check_fields,
    check_pair,
    check_put,
    check_rows,
    check_upsert,
    check_writable,
    put_error,
    rows_by_key,
    same_put,
)
from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.partition import Partition
from tqstream.controller.peers import peer_of
from tqstream.controller.records import Effects, Ids
from tqstream.controller.rows import Row, check_versions
from tqstream.controller.units import UnitTable
from tqstream.errors import (
    CapacityError,
    InvalidRequestError,
    PartitionClosedError,
    PlacementRequiredError,
    RequestTimeoutError,
    TQStreamError,
    UnitLostError,
)
from tqstream.protocol.messages import (
    FieldsPlan,
    PackedMeta,
    PlanSegment,
    PrepareFields,
    PreparePut,
    PutPlan,
    StoredReply,
)
from tqstream.types import BatchMeta


class Puts:
    def __init__(
        self,
        catalog: Catalog,
        units: UnitTable,
        deadlines: DeadlineHeap,
        ids: Ids,
        put_timeout: float,
        max_rows: int,
    ) -> None:
        self.catalog = catalog
        self.units = units
        self.book = PutBook()  # owned here: puts open, end and wait by this class only
        self.deadlines = deadlines
        self.ids = ids
        self.put_timeout = put_timeout
        self.max_rows = max_rows  # rows held at most, over every partition; 0: no cap

    def prepare_put(
        self,
        req: PreparePut,
        now: float,
        handle: Any = None,
        since: float | None = None,
        pinned: int | None = None,
        replica: int = -1,
    ) -> PutPlan | None:
        """Validate and reserve; with ``handle``, a put that does not fit the units' byte quotas
        waits (returns None; answered later through the ``Effects`` of the call that frees room) up
        to ``req.timeout``.
        ``since``: when a waiting put first asked (its timeout counts from then). ``pinned``: the
        rows go to that unit only (its data is there already, see :meth:`put_stored`), their copy
        to ``replica`` (which holds it already, see :meth:`put_paired`)."""
        check_put(req)
        check_rows(self.catalog.partitions, self.max_rows, req.partition, req.n_rows)
        if pinned is None:
            runs = self.units.place(
                req.n_rows, req.nbytes, self.catalog.replicas_of(req.partition), req.near
            )
        else:
            if (
                replica < 0
                and self.catalog.replicas_of(req.partition) > 1
                and len(self.units.live()) > 1
            ):
                raise PlacementRequiredError(
                    f"partition {req.partition!r} keeps 2 copies of every row: a put to it goes "
                    f"to two units at once (or is placed by the controller), not stored on one "
                    f"unit only; put again (the client does so by itself)",
                    partition=req.partition,
                    replicas=2,
                )
            runs = self.units.place_on(pinned, req.n_rows, req.nbytes, replica)
            if runs is None and (replica >= 0 or self.units.room_elsewhere(pinned, req.nbytes)):
                which = f"storage unit {pinned}" if replica < 0 else f"unit {pinned} or {replica}"
                raise PlacementRequiredError(
                    f"{which} has no room for this put's {req.nbytes} bytes (its quota): the put "
                    f"is placed by the controller instead (the client does so by itself)",
                    partition=req.partition,
                    unit=pinned,
                    full=True,
                )
        if runs is None:  # no room now: back-pressure, never a silent drop
            if handle is None or req.timeout == 0:
                raise capacity_error(req, 0.0, self.units)
            self.book.park(handle, WaitingPut(req, now if since is None else since, pinned))
            if req.timeout is not None and since is None:
                self.deadlines.add(now + req.timeout, "putwait", handle)
            return None
        created = req.partition not in self.catalog.partitions
        if not created and self.catalog.partitions[req.partition].closed:
            p = self.catalog.partitions[req.partition]
            raise PartitionClosedError(
                f"partition {req.partition!r} is closed: its {p.producers} producer(s) called "
                f"close_partition, so it takes no new rows (put_fields to its rows still works); "
                f"put to another partition, or clear_partition({req.partition!r}) to start over",
                partition=req.partition,
            )
        self.catalog.create(req.partition, [])
        p = self.catalog.partitions[req.partition]
        known = len(p.bits)
        mask = p.check_schemas(req.schemas)
        try:
            ids = p.reserve_rows(
                req.n_rows, req.keys, req.groups, req.group_size, req.version,
                frozenset(req.schemas),
            )  # fmt: skip
        except TQStreamError:
            p.forget_unused_schemas(req.schemas, self.book.fields_in_flight(req.partition))
            for f in list(p.bits)[known:]:  # fields only this refused put introduced
                del p.bits[f]
            if created:
                del self.catalog.partitions[req.partition]
            raise
        if req.tags is not None:
            for rid, tags in zip(ids, req.tags, strict=True):
                p.row(rid).merge_tags(tags)
        t = p.rows
        for col, vs in ((t.vstart, req.version_start), (t.vend, req.version_end),
                        (t.vdisp, req.dispatch_version)):  # fmt: skip
            if vs is not None:
                p.set_versions(col, ids, vs)
        per_row = req.nbytes // req.n_rows
        segments = []
        for unit, replica, start, stop in runs:
            chunk = next(self.ids)
            segments.append(
                PlanSegment(unit=unit, chunk=chunk, start=start, stop=stop, replica=replica)
            )
            p.place(ids[start:stop], unit, replica, per_row)
            self.units.charge(unit, replica, per_row * (stop - start))
        put = self._add_pending(
            req.partition, ids, mask, list(req.schemas), segments, True, per_row, now,
            peer_of(handle),
            timed=pinned is None,  # a stored put commits at once: no put_timeout to watch
        )  # fmt: skip
        put.rejected = req.rejected  # an aborted put that is retried must not count them twice
        put.shapes = req.shapes
        return PutPlan(rid=req.rid, put_id=put.put_id, first_row=ids.start, n_rows=len(ids),
                       segments=segments, generation=p.born)  # fmt: skip

    def prepare_fields(self, req: PrepareFields, now: float, owner: Any = None) -> FieldsPlan:
        """Plan a put_fields: new columns (or, with ``overwrite``, new values) for committed rows,
        each stored where its row is (and on its replica). Rows named by key that do not exist
        are created with ``create`` (placed like a put's rows, visible at the commit). ``owner``:
        the requester's peer (its put is aborted if it goes away). Nothing changes on error."""
        named = check_fields(req)
        p = self.catalog.partitions.get(req.partition)
        if p is None and req.keys is not None and req.create:
            p = Partition(req.partition, "")  # every key is new: validated against nothing
        elif p is None:
            p = self.catalog.partition(req.partition)  # raises
        check_versions(req.version_start, "version_start")
        check_versions(req.version_end, "version_end")
        if req.keys is None:
            old: list[Row | None] = list(self.catalog.rows(p, req.row_ids))
            new_keys: list[str] = []
        else:
            old, new_keys = rows_by_key(p, req.keys, req.create)
        check_writable(p, req, [r for r in old if r is not None], len(named))
        if new_keys and p.closed:
            raise PartitionClosedError(
                f"partition {req.partition!r} is closed: it takes no new rows ({len(new_keys)} "
                f"keys of this write do not exist in it)",
                partition=req.partition,
            )
        check_rows(self.catalog.partitions, self.max_rows, req.partition, len(new_keys))
        share = req.nbytes * len(new_keys) // len(named)  # placed by the bytes they bring
        runs = self._place_new(req.partition, len(new_keys), share)
        if req.partition not in self.catalog.partitions:
            self.catalog.create(req.partition, [])
            p = self.catalog.partitions[req.partition]
        mask = p.check_schemas(req.schemas)
        created = p.reserve_rows(len(new_keys), new_keys, None, None, None, frozenset())
        for unit, replica, start, stop in runs:
            p.place(created[start:stop], unit, replica)
        fresh = iter(created)
        rows = [p.row(next(fresh)) if r is None else r for r in old]
        by_unit: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(rows):
            r.pending |= mask
            by_unit.setdefault((r.unit, r.replica), []).append(i)
        per_row = req.nbytes // len(rows)
        segments, positions = [], []
        for (unit, replica), pos in sorted(by_unit.items()):
            chunk = next(self.ids)
            segments.append(
                PlanSegment(unit=unit, chunk=chunk, start=0, stop=len(pos), replica=replica)
            )
            positions.append(pos)
        for r in rows:
            r.nbytes += per_row
            self._charge(r, per_row)
        put = self._add_pending(
            req.partition, [r.id for r in rows], mask, list(req.schemas), segments, False,
            per_row, now, owner,
        )  # fmt: skip
        put.created = set(created)
        put.units = [(r.unit, r.replica) for r in rows]
        put.tags = req.tags
        put.shapes = req.shapes
        # only values some row already holds are staged at the units and need publishing
        put.overwrite = req.overwrite and any(r.written & mask for r in rows)
        if req.version_start is not None or req.version_end is not None:
            starts = req.version_start or req.version_end or []
            put.versions = (starts, req.version_end or starts)
        put.keyed = req.keys is not None
        return FieldsPlan(
            rid=req.rid,
            put_id=put.put_id,
            segments=segments,
            positions=positions,
            row_ids=[r.id for r in rows] if put.keyed else [],
            generation=p.born,
        )

    def _place_new(
        self, partition: str, n: int, nbytes: int = 0
    ) -> list[tuple[int, int, int, int]]:
        """Units for ``n`` new rows bringing ``nbytes`` (0: none yet; their fields, written later,
        follow them there)."""
        if not n:
            return []
        runs = self.units.place(n, nbytes, self.catalog.replicas_of(partition))
        if runs is None:
            raise CapacityError(
                f"no live storage unit of partition {partition!r} is under its byte quota, so "
                f"{n} new rows cannot be placed; free room (ack or clear rows) or raise "
                f"--storage-max-bytes",
                partition=partition,
                rows=n,
            )
        return runs

    def _add_pending(
        self,
        partition: str,
        ids: Sequence[int],
        mask: int,
        fields: list[str],
        segments: list[PlanSegment],
        new_rows: bool,
        per_row: int,
        now: float,
        owner: Any = None,
        timed: bool = True,
    ) -> PendingPut:
        put = PendingPut(
            next(self.ids),
            partition,
            ids,
            mask,
            fields,
            [(u, s.chunk) for s in segments for u in (s.unit, s.replica) if u >= 0],
            new_rows,
            per_row,
            owner=owner,
        )
        self.book.open(put)
        if timed:
            self.deadlines.add(now + self.put_timeout, "put", put.put_id)
        return put

    def commit(self, put_id: int, now: float) -> tuple[BatchMeta | PackedMeta | None, Effects]:
        put = self.book.get(put_id)
        if put is None:
            raise self.put_error(put_id)
        effects = Effects()
        self.book.end(put_id, "cleared" if put.cancelled else "committed")
        if put.cancelled:
            self.rollback(put, effects)
            return None, effects  # the service sends the drops, then raises
        p = self.catalog.partitions[put.partition]
        if put.new_rows:
            p.commit_rows(put.ids, put.mask)
            if put.shapes:
                p.shapes.write(put.ids, put.shapes)
            p.produced += len(put.ids)
            p.rejected += put.rejected
            if p.ttl is not None:
                self.deadlines.add(now + p.ttl, "ttl", (p, list(put.ids)))
        else:
            unit_rows = effects.drop_rows
            for rid, (u1, u2) in zip(put.ids, put.units, strict=True):
                if rid not in put.created and rid not in p.rows:  # cleared while in flight:
                    for u in (u1, u2):  # the unit drops what it stored
                        if u >= 0:
                            unit_rows.setdefault(u, {}).setdefault(p.name, []).append(rid)
            live = [p.row(rid) for rid in put.ids if rid in p.rows]
            if put.tags is not None:
                for rid, tags in zip(put.ids, put.tags, strict=True):
                    if rid in p.rows:
                        p.row(rid).merge_tags(tags)
            if put.versions is not None:  # rows that have none take the write's
                for rid, start, end in zip(put.ids, *put.versions, strict=True):
                    if rid not in p.rows:
                        continue
                    r = p.row(rid)
                    if r.version_start is None and r.version_end is None:
                        r.version_start = r.dispatch_version = start
                        r.version_end = end
            p.commit_fields([r for r in live if r.id not in put.created], put.mask)
            if put.shapes:
                p.shapes.write(put.ids, put.shapes, [rid in p.rows for rid in put.ids])
            if put.overwrite:
                for unit, chunk in put.chunks:
                    effects.publish.setdefault(unit, []).append(chunk)
            if put.created:  # after the rows that existed: the order of first readiness
                fresh = [r for r in live if r.id in put.created]
                for r in fresh:
                    r.pending &= ~put.mask
                p.commit_rows([r.id for r in fresh], put.mask)
                p.produced += len(fresh)
                if p.ttl is not None:
                    self.deadlines.add(now + p.ttl, "ttl", (p, [r.id for r in fresh]))
        effects.touched.add(put.partition)
        meta: BatchMeta | PackedMeta | None = None
        if put.new_rows:
            meta = self.catalog.put_meta(p, put.ids, put.fields)
        elif put.keyed:
            meta = self.catalog.meta(p, put.ids, p.common_fields(map(p.row, put.ids)))
        return meta, effects

    def put_stored(
        self,
        req: PreparePut,
        unit: int,
        now: float,
        handle: Any = None,
        since: float | None = None,
    ) -> tuple[StoredReply | None, Effects]:
        """A put whose columns storage unit ``unit`` already holds (``PutRows``): its rows are
        placed on that unit and committed in one step, or the put waits for room there like any
        put (None). Refused puts change nothing; the unit then drops the columns."""
        plan = self.prepare_put(req, now, handle, since, unit)
        if plan is None:
            return None, Effects()
        meta, effects = self.commit(plan.put_id, now)
        assert meta is not None  # a new put's rows, committed in the same step
        return StoredReply.of(req.rid, plan.segments[0].chunk, meta), effects

    def put_paired(
        self, req: PreparePut, unit: int, now: float, handle: Any
    ) -> tuple[StoredReply | None, list[Any], Effects]:
        """One copy of a replicated one-exchange put (``req.pair``), held by unit ``unit``. The
        first copy to arrive waits for the other (up to ``put_timeout``; it fails if a unit of
        the pair is lost); with both, the rows are placed on the pair's first unit with the
        second as their replica and committed in one step. Returns the committed rows' reply
        (None while waiting or refused: refusals fail both copies through the effects) and the
        handles it answers. A copy refused stores nothing: its unit drops the columns."""
        pair = req.pair
        assert pair is not None
        effects = Effects()
        check_pair(req, unit, self.catalog.replicas_of(req.partition), self.units)
        other = self.book.take_half(pair.token)
        if other is None:
            self.book.hold_half(pair.token, Half(req, unit, handle))
            self.deadlines.add(now + self.put_timeout, "pair", pair.token)
            return None, [], effects
        handles = [other.handle, handle]
        if other.unit == unit or not same_put(other.req, req):
            exc: TQStreamError = InvalidRequestError(
                f"the two copies of a replicated put (pair {pair.token}) differ or came from "
                f"one unit; nothing was stored: put again",
                partition=req.partition,
            )
            effects.failed += [(h, exc) for h in handles]
            return None, [], effects
        one = msgspec.structs.replace(req, pair=None)
        try:
            plan = self.prepare_put(one, now, None, None, pair.units[0], pair.units[1])
        except TQStreamError as refused:
            effects.failed += [(h, refused) for h in handles]
            return None, [], effects
        assert plan is not None
        meta, effects = self.commit(plan.put_id, now)
        assert meta is not None
        return StoredReply.of(req.rid, plan.segments[0].chunk, meta), handles, effects

    def expire_pair(self, token: int, effects: Effects) -> None:
        """One copy of a replicated put waited ``put_timeout`` for the other: it fails."""
        half = self.book.take_half(token)
        if half is not None:
            units = half.req.pair.units if half.req.pair is not None else [half.unit]
            exc = RequestTimeoutError(
                f"the other copy of this put (to storage units {units}) did not reach the "
                f"controller within put_timeout={self.put_timeout}s; nothing was stored: put again",
                partition=half.req.partition,
            )
            effects.failed.append((half.handle, exc))

    def put_error(self, put_id: int) -> TQStreamError:
        return put_error(put_id, self.book.status(put_id), self.put_timeout)

    def abort(self, put_id: int) -> Effects:
        effects = Effects()
        put = self.book.end(put_id, "aborted")
        if put is not None:
            self.rollback(put, effects)
        return effects

    def rollback(self, put: PendingPut, effects: Effects) -> None:
        for unit, chunk in put.chunks:
            effects.drop_chunks.setdefault(unit, []).append(chunk)
        if put.cancelled:
            return  # the partition and its rows are gone already
        p = self.catalog.partitions[put.partition]
        if put.new_rows:
            self._uncharge(p, p.remove_rows(put.ids))
        else:
            self._uncharge(p, p.remove_rows([rid for rid in put.created if rid in p.rows]))
            for rid in put.ids:
                if rid not in p.rows:
                    continue  # cleared (or created by this put) : its bytes are uncharged already
                r = p.row(rid)
                r.pending &= ~put.mask
                r.nbytes -= put.per_row
                self._charge(r, -put.per_row)
        p.forget_unused_schemas(put.fields, self.book.fields_in_flight(put.partition))
        effects.room = True

    def upsert_rows(
        self,
        partition: str,
        keys: list[str],
        tags: list[Any] | None,
        create: bool,
        row_ids: list[int] | None,
        now: float,
    ) -> BatchMeta:
        """Merge ``tags`` into the rows of ``keys``; with ``create``, keys that do not exist become
        rows without fields, placed on a unit like a put's rows (their fields, written later, go
        there). Without keys, the rows are ``row_ids`` (which must exist). Returns the rows'
        metadata with the fields they all have. Nothing changes on error."""
        if not keys and row_ids:
            named = self.catalog.partition(partition)
            found = self.catalog.rows(named, row_ids)
            if tags is not None and len(tags) != len(found):
                raise InvalidRequestError(
                    f"tags= has {len(tags)} entries but {len(found)} rows were named"
                )
            for r, t in zip(found, tags or [], strict=False):
                r.merge_tags(t)
            return self.catalog.meta(named, [r.id for r in found], named.common_fields(found))
        check_upsert(keys, tags)
        p = self.catalog.partitions.get(partition)
        if p is None and not create:
            p = self.catalog.partition(partition)  # raises
        old, new_keys = rows_by_key(p or Partition(partition, ""), keys, create)
        check_rows(self.catalog.partitions, self.max_rows, partition, len(new_keys))
        runs = self._place_new(partition, len(new_keys))
        if p is None:
            self.catalog.create(partition, [])
            p = self.catalog.partitions[partition]
        elif new_keys and p.closed:
            raise PartitionClosedError(
                f"partition {partition!r} is closed: it takes no new rows ({len(new_keys)} keys "
                f"do not exist in it)",
                partition=partition,
            )
        created = p.reserve_rows(len(new_keys), new_keys, None, None, None, frozenset())
        for unit, replica, start, stop in runs:
            p.place(created[start:stop], unit, replica)
        p.commit_rows(created, 0)
        p.produced += len(created)
        if created and p.ttl is not None:
            self.deadlines.add(now + p.ttl, "ttl", (p, list(created)))
        fresh = iter(created)
        rows = [p.row(next(fresh)) if r is None else r for r in old]
        if tags is not None:
            for r, t in zip(rows, tags, strict=True):
                r.merge_tags(t)
        return self.catalog.meta(p, [r.id for r in rows], p.common_fields(rows))

    def partition_cleared(self, partition: str) -> None:
        """Its puts in flight are cancelled: their commit or deadline still drops their chunks."""
        for put in self.book.where(partition=partition):
            put.cancelled = True

    def lose_unit(self, u: int, effects: Effects) -> None:
        """Unit ``u`` is gone: puts in flight that stored on it roll back, the copies of
        replicated puts it held or was to hold fail (``UnitLostError``)."""
        for put in self.book.where(unit=u):
            self.book.end(put.put_id, "unit-lost")
            self.rollback(put, effects)
        for token, half in self.book.halves_with(u):  # a copy of a replicated put: no pair now
            self.book.take_half(token)
            effects.failed.append((half.handle, UnitLostError(
                f"storage unit {u} ({self.units.addresses[u]}), one of the two units of a "
                f"replicated put, was lost before both held the rows; nothing was stored: put "
                f"again", unit=u, partition=half.req.partition,
            )))  # fmt: skip

    def drop_peer(self, peer: Any, effects: Effects) -> None:
        """The producer ``peer`` went away: its waiting puts are forgotten, its puts in flight
        rolled back."""
        for handle, _ in self.book.waiting():
            if peer_of(handle) == peer:
                self.book.unpark(handle)
        for put in self.book.where(owner=peer):
            self.book.end(put.put_id, "aborted")
            self.rollback(put, effects)

    def retry_waiting(self, effects: Effects, now: float) -> None:
        """Bytes were freed: retry waiting puts in arrival order."""
        for handle, _ in self.book.waiting():
            waiting = self.book.unpark(handle)
            if waiting is None:  # ended by an earlier retry of this loop
                continue
            req, since, unit = waiting
            at = max(now, since)
            try:
                if unit is None:
                    reply: Any = self.prepare_put(req, at, handle, since)
                else:
                    reply, more = self.put_stored(req, unit, at, handle, since)
                    effects.extend(more)
            except TQStreamError as exc:
                effects.failed.append((handle, exc))
                continue
            if reply is not None:
                effects.replies.append((handle, reply))

    def _uncharge(self, p: Partition, removed: list[int]) -> None:
        """Rows ``removed`` (just removed from ``p``) no longer count on their units."""
        if removed:
            for u, nbytes in p.rows.on_units(removed)[0].items():
                self.units.bytes[u] -= nbytes

    def _charge(self, r: Row, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer) on the units holding row ``r``."""
        self.units.charge(r.unit, r.replica, nbytes)

    # --- deadlines ---
    def expire_put(self, put_id: int, effects: Effects) -> None:
        """A put not committed within ``put_timeout`` (or cleared meanwhile) is rolled back."""
        put = self.book.get(put_id)
        if put is not None:
            self.book.end(put_id, "cleared" if put.cancelled else "expired")
            self.rollback(put, effects)

    def expire_wait(self, handle: Any, now: float, effects: Effects) -> None:
        """A put waiting for room past its timeout fails."""
        waiting = self.book.unpark(handle)
        if waiting is not None:
            effects.failed.append(
                (handle, capacity_error(waiting.req, now - waiting.since, self.units))
            )
