"""Puts inside the controller state: plan, commit, abort — a mixin of
:class:`~tqstream.controller.state.ControllerState`, split out to keep each file one concept.

A put is two-phase: ``prepare_put`` validates everything, reserves keys, group slots and row ids
and places the rows on storage units (and each run's replica on another unit when the partition
keeps two copies); the client stores the chunks; ``commit`` makes the rows visible at once.
``abort`` (or the put deadline, or the loss of a unit it stored on, or its producer's disconnect)
removes the reservation and orders the units to drop whatever chunks arrived, so a failed put
leaves neither rows nor bytes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tqstream.controller.partition import Partition, Row
from tqstream.controller.peers import peer_of
from tqstream.controller.records import Effects, PendingPut
from tqstream.controller.units import UnitTable
from tqstream.errors import (
    CapacityError,
    FieldExistsError,
    InvalidRequestError,
    PartitionClearedError,
    PartitionClosedError,
    PlacementRequiredError,
    RequestTimeoutError,
    TQStreamError,
    UnitLostError,
)
from tqstream.protocol.messages import (
    FieldsPlan,
    PlanSegment,
    PrepareFields,
    PreparePut,
    PutPlan,
    StoredReply,
)
from tqstream.types import BatchMeta


class Puts:
    partitions: dict[str, Partition]
    units: UnitTable
    pending: dict[int, PendingPut]
    waiting_puts: dict[Any, tuple[PreparePut, float, int | None]]
    finished_puts: OrderedDict[int, str]
    put_timeout: float
    now: float
    outbox: Effects
    _ids: itertools.count[int]

    if TYPE_CHECKING:

        def _at(self, deadline: float, kind: str, ref: Any) -> None: ...
        def _capacity_error(self, req: PreparePut, waited: float) -> CapacityError: ...
        def partition(self, name: str) -> Partition: ...
        def _serve_parked_puts(self) -> None: ...
        def _serve_parked(self, partition: str, effects: Effects, now: float) -> None: ...
        def _finish(self, record: OrderedDict[int, str], key: int, status: str) -> None: ...
        def _rows(self, p: Partition, row_ids: list[int]) -> list[Row]: ...
        def _meta(self, p: Partition, rows: list[Row], fields: list[str]) -> BatchMeta: ...
        def create_partition(self, name: str, fields: list[str]) -> None: ...
        def replicas_of(self, partition: str) -> int: ...

    def _charge(self, r: Row, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer) on the units holding row ``r``."""
        self.units.bytes[r.unit] += nbytes
        if r.replica >= 0:
            self.units.bytes[r.replica] += nbytes

    def prepare_put(
        self,
        req: PreparePut,
        now: float,
        handle: Any = None,
        since: float | None = None,
        pinned: int | None = None,
    ) -> PutPlan | None:
        """Validate and reserve; with ``handle``, a put that does not fit the units' byte quotas
        waits (returns None; answered later through ``take_effects``) up to ``req.timeout``.
        ``since``: when a waiting put first asked (its timeout counts from then). ``pinned``: the
        rows go to that unit only (its data is there already, see :meth:`put_stored`)."""
        self.now = max(self.now, now)
        if req.n_rows <= 0 or not req.schemas:
            raise InvalidRequestError(
                f"a put needs at least one row and one field (got "
                f"{req.n_rows} rows, {len(req.schemas)} fields)"
            )
        for name, seq in (("keys", req.keys), ("groups", req.groups)):
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
        if pinned is None:
            runs = self.units.place(req.n_rows, req.nbytes, self.replicas_of(req.partition))
        else:
            if self.replicas_of(req.partition) > 1 and len(self.units.live()) > 1:
                raise PlacementRequiredError(
                    f"partition {req.partition!r} keeps 2 copies of every row: a put to it is "
                    f"placed by the controller, not stored on one unit first; put again (the "
                    f"client does so by itself)",
                    partition=req.partition,
                )
            runs = self.units.place_on(pinned, req.n_rows, req.nbytes)
        if runs is None:  # no room now: back-pressure, never a silent drop
            if handle is None or req.timeout == 0:
                raise self._capacity_error(req, 0.0)
            self.waiting_puts[handle] = (req, now if since is None else since, pinned)
            if req.timeout is not None and since is None:
                self._at(now + req.timeout, "putwait", handle)
            return None
        created = req.partition not in self.partitions
        if not created and self.partitions[req.partition].closed:
            p = self.partitions[req.partition]
            raise PartitionClosedError(
                f"partition {req.partition!r} is closed: its {p.producers} producer(s) called "
                f"close_partition, so it takes no new rows (put_fields to its rows still works); "
                f"put to another partition, or clear_partition({req.partition!r}) to start over",
                partition=req.partition,
            )
        self.create_partition(req.partition, [])
        p = self.partitions[req.partition]
        known = len(p.bits)
        mask = p.check_schemas(req.schemas)
        try:
            rows = p.reserve_rows(
                req.n_rows, req.keys, req.groups, req.group_size, req.version,
                frozenset(req.schemas),
            )  # fmt: skip
        except TQStreamError:
            p.forget_unused_schemas(req.schemas, self._pending_fields(req.partition))
            for f in list(p.bits)[known:]:  # fields only this refused put introduced
                del p.bits[f]
            if created:
                del self.partitions[req.partition]
            raise
        for i, r in enumerate(rows):
            if req.version_start is not None:
                r.version_start = req.version_start[i]
            if req.version_end is not None:
                r.version_end = req.version_end[i]
            if req.dispatch_version is not None:
                r.dispatch_version = req.dispatch_version[i]
        per_row = req.nbytes // req.n_rows
        segments = []
        for unit, replica, start, stop in runs:
            chunk = next(self._ids)
            segments.append(
                PlanSegment(unit=unit, chunk=chunk, start=start, stop=stop, replica=replica)
            )
            for r in rows[start:stop]:
                r.unit, r.replica, r.nbytes = unit, replica, per_row
                self._charge(r, per_row)
        put = self._add_pending(
            req.partition, rows, mask, list(req.schemas), segments, True, per_row, now,
            peer_of(handle),
            timed=pinned is None,  # a stored put commits at once: no put_timeout to watch
        )  # fmt: skip
        put.rejected = req.rejected  # an aborted put that is retried must not count them twice
        return PutPlan(
            rid=req.rid, put_id=put.put_id, row_ids=[r.id for r in rows], segments=segments
        )

    def prepare_fields(self, req: PrepareFields, now: float, owner: Any = None) -> FieldsPlan:
        """Plan a put_fields: new columns for committed rows, each stored where its row is (and
        on its replica). ``owner``: the requester's peer (its put is aborted if it goes away)."""
        p = self.partition(req.partition)
        if not req.row_ids or not req.schemas:
            raise InvalidRequestError("put_fields needs at least one row and one field")
        if len(set(req.row_ids)) < len(req.row_ids):
            twice = next(r for i, r in enumerate(req.row_ids) if r in req.row_ids[:i])
            raise InvalidRequestError(
                f"put_fields names row {twice} more than once; a field is written once per row",
                row=twice,
            )
        rows = self._rows(p, req.row_ids)
        for name, _schema in req.schemas.items():
            bit = p.bits.get(name, 0)
            taken = [r.key for r in rows if (r.written | r.pending) & bit]
            if taken:
                raise FieldExistsError(
                    f"field {name!r} is already written (or being written) for {len(taken)} of the "
                    f"{len(rows)} rows in partition {req.partition!r} (e.g. key {taken[0]!r}); "
                    f"fields cannot be overwritten: write the new values under another name",
                    field=name,
                    rows=len(taken),
                )
        mask = p.check_schemas(req.schemas)
        by_unit: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(rows):
            r.pending |= mask
            by_unit.setdefault((r.unit, r.replica), []).append(i)
        per_row = req.nbytes // len(rows)
        segments, positions = [], []
        for (unit, replica), pos in sorted(by_unit.items()):
            chunk = next(self._ids)
            segments.append(
                PlanSegment(unit=unit, chunk=chunk, start=0, stop=len(pos), replica=replica)
            )
            positions.append(pos)
        for r in rows:
            r.nbytes += per_row
            self._charge(r, per_row)
        put = self._add_pending(
            req.partition, rows, mask, list(req.schemas), segments, False, per_row, now, owner
        )
        return FieldsPlan(rid=req.rid, put_id=put.put_id, segments=segments, positions=positions)

    def _add_pending(
        self,
        partition: str,
        rows: list[Row],
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
            next(self._ids),
            partition,
            rows,
            mask,
            fields,
            [(u, s.chunk) for s in segments for u in (s.unit, s.replica) if u >= 0],
            new_rows,
            per_row,
            owner=owner,
        )
        self.pending[put.put_id] = put
        if timed:
            self._at(now + self.put_timeout, "put", put.put_id)
        return put

    def _pending_fields(self, partition: str) -> set[str]:
        return {
            f
            for q in self.pending.values()
            if q.partition == partition and not q.cancelled
            for f in q.fields
        }

    def commit(self, put_id: int, now: float) -> tuple[BatchMeta | None, Effects]:
        put = self.pending.pop(put_id, None)
        if put is None:
            raise self.put_error(put_id)
        effects = Effects()
        if put.cancelled:
            self._finish(self.finished_puts, put_id, "cleared")
            self._rollback(put, effects)
            return None, effects  # the service sends the drops, then raises the error
        self._finish(self.finished_puts, put_id, "committed")
        p = self.partitions[put.partition]
        if put.new_rows:
            p.commit_rows(put.rows, put.mask)
            p.produced += len(put.rows)
            p.rejected += put.rejected
            if p.ttl is not None:
                self._at(now + p.ttl, "ttl", (p, [r.id for r in put.rows]))
        else:
            gone = [r.id for r in put.rows if r.id not in p.rows]  # cleared while in flight
            if gone:
                unit_rows = effects.drop_rows
                for r in put.rows:
                    if r.id not in p.rows:
                        unit_rows.setdefault(r.unit, {}).setdefault(p.name, []).append(r.id)
            p.commit_fields([r for r in put.rows if r.id in p.rows], put.mask)
        self._serve_parked(put.partition, effects, now)
        meta = self._meta(p, put.rows, put.fields) if put.new_rows else None
        return meta, effects

    def put_stored(
        self,
        req: PreparePut,
        unit: int,
        now: float,
        handle: Any = None,
        since: float | None = None,
    ) -> StoredReply | None:
        """A put whose columns storage unit ``unit`` already holds (``PutRows``): its rows are
        placed on that unit and committed in one step, or the put waits for room there like any
        put (None). Refused puts change nothing; the unit then drops the columns."""
        plan = self.prepare_put(req, now, handle, since, unit)
        if plan is None:
            return None
        meta, effects = self.commit(plan.put_id, now)
        self.outbox.extend(effects)
        assert meta is not None  # a new put's rows, committed in the same step
        return StoredReply(rid=req.rid, chunk=plan.segments[0].chunk, meta=meta)

    def put_error(self, put_id: int) -> TQStreamError:
        status = self.finished_puts.get(put_id)
        if status == "expired":
            return RequestTimeoutError(
                f"put {put_id} was not committed within put_timeout={self.put_timeout}s and was "
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

    def abort(self, put_id: int) -> Effects:
        effects = Effects()
        put = self.pending.pop(put_id, None)
        if put is not None:
            self._finish(self.finished_puts, put_id, "aborted")
            self._rollback(put, effects)
        return effects

    def _rollback(self, put: PendingPut, effects: Effects) -> None:
        for unit, chunk in put.chunks:
            effects.drop_chunks.setdefault(unit, []).append(chunk)
        if put.cancelled:
            return  # the partition and its rows are gone already
        p = self.partitions[put.partition]
        if put.new_rows:
            for r in p.remove_rows([r.id for r in put.rows]):
                self._charge(r, -r.nbytes)
        else:
            for r in put.rows:
                if p.rows.get(r.id) is not r:
                    continue  # cleared since: clear_samples freed its bytes, this put's included
                r.pending &= ~put.mask
                r.nbytes -= put.per_row
                self._charge(r, -put.per_row)
        p.forget_unused_schemas(put.fields, self._pending_fields(put.partition))
        self._serve_parked_puts()
