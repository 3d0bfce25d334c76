"""The controller's whole state, pure: no sockets, no clock (``now`` is an argument).

:class:`ControllerState` composes the parts, each an object that owns its fields, and is the one
entry point of the service: one method per request, each returning what the service must do
(:class:`~tqstream.controller.records.Effects`: replies to parked requests, failures, drop orders
for storage units), alone or beside its answer. A method raises only before it has changed
anything.

The parts, and what each owns:

- :class:`~tqstream.controller.catalog.Catalog` — the partitions (each owning its rows) and row
  eviction;
- :class:`~tqstream.controller.puts.Puts` — writes: plans, commits, rollbacks, puts waiting for
  room (over the ``PutBook``);
- :class:`~tqstream.controller.gets.Gets` — reads: gets served or parked (``ParkedGets``), leases
  (``LeaseTable``), acks and releases;
- :class:`~tqstream.controller.flow.Flow` — producer admission (``AdmissionTable``) and
  StalenessManager budgets;
- :class:`~tqstream.controller.faults.Faults` — lost and revived units, peers that went away;
- the ``UnitTable`` (units, their bytes and placement) and the ``DeadlineHeap`` (every deadline).

A part never calls another's waiters: it signals in the effects — a partition's rows changed
(``touched``), room was freed (``room``), an admission freed slots (``woken``) — and
:meth:`ControllerState.settle` carries the signals out before the effects leave the state. Every
deadline sits in one heap; the service keeps a single timer at :meth:`next_deadline` and calls
:meth:`expire`, which hands each due entry to the part that owns its kind, so nothing polls.
"""

from __future__ import annotations

from typing import Any

from tqstream.controller.catalog import Catalog
from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.faults import Faults
from tqstream.controller.flow import Flow
from tqstream.controller.gets import Gets
from tqstream.controller.leases import Leases
from tqstream.controller.parked import Parked
from tqstream.controller.partition import Partition
from tqstream.controller.puts import Puts
from tqstream.controller.records import DeadlineKind, Effects, Ids
from tqstream.controller.units import UnitTable
from tqstream.errors import TQStreamError
from tqstream.protocol.messages import (
    Acquire,
    BudgetReport,
    FieldsPlan,
    GetMeta,
    PackedMeta,
    PrepareFields,
    PreparePut,
    PutPlan,
    StoredReply,
)
from tqstream.types import BatchMeta, PartitionStats, RowListing


class ControllerState:
    def __init__(
        self,
        *,
        lease_timeout: float = 300.0,
        put_timeout: float = 60.0,
        replicas: int = 1,
        max_rows: int = 0,
    ) -> None:
        self.now = 0.0  # the latest time seen: a put woken by freed bytes is planned at it
        self.ids = Ids()  # put, lease, chunk and partition-incarnation ids
        self.units = UnitTable()
        self.deadlines = DeadlineHeap(self._live)
        self.catalog = Catalog(self.units, self.ids, replicas)
        self.flow = Flow(self.deadlines)
        self.writes = Puts(
            self.catalog, self.units, self.deadlines, self.ids, put_timeout, max_rows
        )
        self.leasing = Leases(self.catalog, self.ids, self.deadlines, lease_timeout)
        self.reads = Gets(self.catalog, self.leasing, self.writes.book, self.deadlines, self.flow)
        self.faults = Faults(self.catalog, self.writes, self.reads, self.leasing, self.flow,
                             self.units, self.ids)  # fmt: skip
        # the tables, for reading (each is changed by its owner only)
        self.partitions = self.catalog.partitions
        self.puts = self.writes.book
        self.leases = self.leasing.table
        self.parked = self.reads.parked
        self.admissions = self.flow.admissions
        self.budgets = self.flow.budgets

    def __setstate__(self, state: dict[str, Any]) -> None:
        """From a journal's snapshot: the callbacks between the parts are bound again."""
        self.__dict__.update(state)
        self.deadlines._live = self._live
        self.catalog.on_evict.append(self.leases.forget_rows)

    @property
    def replicas(self) -> int:
        """Copies of each row, for partitions that do not say."""
        return self.catalog.replicas

    @property
    def next_rows(self) -> dict[str, int]:
        return self.catalog.next_rows

    def settle(self, effects: Effects, now: float) -> Effects:
        """Carry out the signals between the parts that ``effects`` holds — serve the parked gets
        of touched partitions, retry the puts waiting for room once some was freed, grant woken
        acquires — until none is left (each may raise more), and return the effects for the
        service."""
        while effects.touched or effects.room or effects.woken:
            if effects.woken:
                names, effects.woken = effects.woken, set()
                for name in sorted(names):
                    if name in self.admissions:
                        self.flow.wake(name, effects)
            elif effects.room:
                effects.room = False
                self.writes.retry_waiting(effects, max(self.now, now))
            else:
                name = min(effects.touched)
                effects.touched.discard(name)
                self.reads.serve_parked(name, effects, now)
        return effects

    # --- units and partitions ---
    def add_unit(self, address: str, max_bytes: int = 0) -> tuple[int, Effects]:
        """Register a storage unit; a lost one registering again revives (empty): see
        :meth:`revive_unit`."""
        u, lost = self.units.add(address, max_bytes)
        return u, self.revive_unit(u) if lost else Effects()

    def lose_unit(self, u: int, now: float) -> Effects:
        return self.settle(self.faults.lose_unit(u), now)

    def revive_unit(self, u: int) -> Effects:
        return self.settle(self.faults.revive_unit(u), self.now)

    def drop_peer(self, peer: Any, now: float) -> Effects:
        return self.settle(self.faults.drop_peer(peer), now)

    def replicas_of(self, partition: str) -> int:
        return self.catalog.replicas_of(partition)

    def partition(self, name: str) -> Partition:
        return self.catalog.partition(name)

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
        self.catalog.create(name, fields, tasks, ttl, admission, producers, replicas)

    def close_partition(self, name: str, now: float) -> tuple[int, Effects]:
        still_open, effects = self.catalog.close(name)
        return still_open, self.settle(effects, now)

    def count_rejected(self, partition: str, count: int) -> None:
        self.catalog.count_rejected(partition, count)

    # --- puts ---
    def prepare_put(
        self,
        req: PreparePut,
        now: float,
        handle: Any = None,
        since: float | None = None,
        pinned: int | None = None,
    ) -> PutPlan | None:
        self.now = max(self.now, now)
        return self.writes.prepare_put(req, now, handle, since, pinned)

    def prepare_fields(self, req: PrepareFields, now: float, owner: Any = None) -> FieldsPlan:
        return self.writes.prepare_fields(req, now, owner)

    def commit(self, put_id: int, now: float) -> tuple[BatchMeta | PackedMeta | None, Effects]:
        meta, effects = self.writes.commit(put_id, now)
        return meta, self.settle(effects, now)

    def put_stored(
        self,
        req: PreparePut,
        unit: int,
        now: float,
        handle: Any = None,
        since: float | None = None,
    ) -> tuple[StoredReply | None, Effects]:
        self.now = max(self.now, now)
        reply, effects = self.writes.put_stored(req, unit, now, handle, since)
        return reply, self.settle(effects, now)

    def put_paired(
        self, req: PreparePut, unit: int, now: float, handle: Any
    ) -> tuple[StoredReply | None, list[Any], Effects]:
        self.now = max(self.now, now)
        reply, handles, effects = self.writes.put_paired(req, unit, now, handle)
        return reply, handles, self.settle(effects, now)

    def put_error(self, put_id: int) -> TQStreamError:
        return self.writes.put_error(put_id)

    def abort(self, put_id: int) -> Effects:
        return self.settle(self.writes.abort(put_id), self.now)

    def upsert_rows(
        self,
        partition: str,
        keys: list[str],
        tags: list[Any] | None,
        create: bool,
        row_ids: list[int] | None = None,
    ) -> BatchMeta:
        return self.writes.upsert_rows(partition, keys, tags, create, row_ids, self.now)

    # --- gets and consumption ---
    def get_meta(self, req: GetMeta, handle: Any, now: float) -> tuple[BatchMeta | None, Effects]:
        """Serve now, or park ``handle`` (answered later through ``Effects``) and return None.
        A get that cannot wait (``timeout=0``) and finds no rows fails through the effects too:
        the attempt may have evicted stale rows, whose drop orders go out with the failure."""
        meta, effects = self.reads.get_meta(req, handle, now)
        return meta, self.settle(effects, now)

    def cancel_parked(self, handle: Any) -> None:
        """The requester went away: forget its parked request."""
        self.reads.cancel_parked(handle)

    def get_by_keys(
        self,
        partition: str,
        keys: list[str],
        fields: list[str] | None,
        row_ids: list[int] | None = None,
        missing_ok: bool = False,
    ) -> BatchMeta:
        return self.reads.get_by_keys(partition, keys, fields, row_ids, missing_ok)

    def list_keys(self, partition: str) -> list[str]:
        return self.reads.list_keys(partition)

    def list_rows(
        self, partition: str | None, fields: list[str], task: str | None
    ) -> dict[str, RowListing]:
        return self.reads.list_rows(partition, fields, task)

    def ack(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], tokens_masked: int = 0,
        resumed: bool = False,
    ) -> tuple[int, Effects]:  # fmt: skip
        n, effects = self.leasing.ack(partition, task, lease_id, row_ids, tokens_masked, resumed)
        return n, self.settle(effects, self.now)

    def release(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], now: float
    ) -> tuple[int, Effects]:
        n, effects = self.leasing.release(partition, task, lease_id, row_ids, now)
        return n, self.settle(effects, now)

    def reset_consumption(
        self, partition: str, task: str | None, now: float
    ) -> tuple[int, Effects]:
        n, effects = self.reads.reset_consumption(partition, task, now)
        return n, self.settle(effects, now)

    # --- admission ---
    def create_admission(self, name: str, style: str, config: dict[str, int]) -> None:
        self.flow.create_admission(name, style, config)

    def acquire(self, req: Acquire, now: float, handle: Any = None) -> list[int] | None:
        return self.flow.acquire(req, now, handle)

    def release_slots(self, name: str, slot_ids: list[int], outcome: str) -> Effects:
        return self.settle(self.flow.release_slots(name, slot_ids, outcome), self.now)

    def admission_version(
        self, name: str, version: int, recovered: bool, reset: bool = False
    ) -> Effects:
        return self.settle(self.flow.admission_version(name, version, recovered, reset), self.now)

    def admission_info(
        self, name: str, version: int | None, enqueued: int
    ) -> tuple[dict[str, int | float | str], int | None]:
        return self.flow.admission_info(name, version, enqueued)

    def budget_report(self, req: BudgetReport, handle: Any = None) -> dict[str, int | float | str]:
        return self.flow.budget_report(req, handle)

    def admission_stats(self) -> dict[str, dict[str, int | float | str]]:
        return self.flow.admission_stats()

    # --- clearing ---
    def clear_samples(self, partition: str, row_ids: list[int]) -> Effects:
        effects = Effects()
        self.catalog.evict(self.catalog.partition(partition), row_ids, effects)
        return self.settle(effects, self.now)

    def clear_partition(self, partition: str) -> Effects:
        """Make sure ``partition`` is gone: clearing one that does not exist does nothing. The
        catalog removes it; its puts in flight, leases and parked gets end with it."""
        effects = Effects()
        if self.catalog.clear(partition, effects):
            self.writes.partition_cleared(partition)
            self.leasing.partition_cleared(partition)
            self.reads.partition_cleared(partition, effects)
        return self.settle(effects, self.now)

    # --- deadlines ---
    def schedule(self, deadline: float, kind: DeadlineKind, ref: Any) -> None:
        self.deadlines.add(deadline, kind, ref)

    def next_deadline(self) -> float | None:
        return self.deadlines.next()

    def expire(self, now: float) -> Effects:
        """Everything whose deadline came by ``now`` ends, each by the part that owns it."""
        self.now = max(self.now, now)
        effects = Effects()
        touched: set[str] = set()  # partitions given rows back by expired leases
        for deadline, kind, ref in self.deadlines.due(now):
            if kind == "lease":
                name = self.leasing.expire(ref, deadline)
                if name is not None:
                    touched.add(name)
            elif kind == "acquire":
                self.flow.expire_acquire(ref, now, effects)
            elif kind == "putwait":
                self.writes.expire_wait(ref, now, effects)
            elif kind == "ttl":
                self.catalog.expire_ttl(ref[0], ref[1], effects)
                self.settle(effects, now)  # puts waiting for room, before their own deadlines
            elif kind == "put":
                self.writes.expire_put(ref, effects)
                self.settle(effects, now)
            elif kind == "pair":
                self.writes.expire_pair(ref, effects)
            else:
                parked: Parked = ref
                if parked.req.partition in touched:  # rows given back before this timeout
                    touched.discard(parked.req.partition)
                    self.reads.serve_parked(parked.req.partition, effects, now)
                self.reads.expire_parked(parked, effects)
        effects.touched |= touched
        return self.settle(effects, now)

    def _live(self, deadline: float, kind: DeadlineKind, ref: Any) -> bool:
        """Whether the thing a deadline ends is still there (its entry is not stale)."""
        if kind == "lease":
            lease = self.leases.get(ref)
            return lease is not None and lease.deadline == deadline
        if kind == "acquire":
            return self.admissions.parked(ref) is not None
        if kind == "putwait":
            return self.puts.parked(ref) is not None
        if kind == "put":
            return ref in self.puts
        if kind == "pair":
            return self.puts.holds_half(ref)
        if kind == "ttl":
            return self.partitions.get(ref[0].name) is ref[0]
        return self.parked.holds(ref)

    # --- stats ---
    def stats(self, partition: str | None) -> dict[str, PartitionStats]:
        names = [partition] if partition is not None else sorted(self.partitions)
        out = {}
        for name in names:
            p = self.partition(name)
            out[name] = PartitionStats(
                rows=p.committed,
                fields={f: p.written_count.get(f, 0) for f in p.bits},
                schemas=dict(p.schemas),
                tasks=p.tasks.task_stats(),
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
