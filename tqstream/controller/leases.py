"""Leases: the batches granted to readers and not yet acked, released, expired or given up, how
the newest ended ones ended (:class:`LeaseTable`), and their one owner (:class:`Leases`): a lease
starts, changes and ends in this module only.

An ack consumes the leased rows for the lease's task (a row every registered task acked is freed)
and records each row's version lag; a release, an expiry or the reader's departure gives the rows
back. An ack that comes after its lease ended is answered by how it ended: a repeat of what the
lease acked is harmless, anything else raises (``LeaseExpiredError``: the rows may have gone to
another reader), and a checkpoint's resumed ack reclaims the rows nobody took since.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Set
from typing import Any, Literal, get_args

from tqstream.controller.catalog import Catalog
from tqstream.controller.deadlines import DeadlineHeap
from tqstream.controller.partition import Partition
from tqstream.controller.records import Effects, Ids, LeaseEnd, Ledger
from tqstream.controller.window import version_of
from tqstream.errors import LeaseError, LeaseExpiredError, UnknownLeaseError
from tqstream.protocol.messages import GetMeta
from tqstream.types import Measure


@dataclasses.dataclass
class Lease:
    lease_id: int
    partition: str
    task: str
    rows: set[int]
    deadline: float
    current_version: int | None = None  # the reader's version, for the lag at consumption
    measure: Measure = "head"
    owner: Any = None  # the reader's peer: its rows go back to available when it disconnects
    acked: set[int] | None = None  # rows acked under it while others stay leased (a partial ack)


PARTLY_ACKED_LIMIT = 10_000
"""Leases that expired after a partial ack whose acked rows are remembered, the newest ones."""


class LeaseTable(Ledger[Lease, LeaseEnd]):
    """The leases granted and not ended (a read-only mapping of id to :class:`Lease`), and how
    the newest ended ones ended: a lease starts only by :meth:`grant` and ends only by
    :meth:`end`."""

    def __init__(self) -> None:
        super().__init__(get_args(LeaseEnd))
        # lease id -> the rows acked under it before it expired or was given up: a repeat of
        # that ack is harmless, any other call on the lease raises (its batch went elsewhere)
        self._partly_acked: dict[int, frozenset[int]] = {}

    def grant(self, lease: Lease) -> None:
        self._start(lease.lease_id, lease)

    def end(self, lease: Lease, status: LeaseEnd) -> None:
        """The lease ends (``status`` answers a late ack or release); ending it again is a
        no-op."""
        ended = self._finish(lease.lease_id, status)
        if ended is not None and ended.acked and status in ("expired", "disconnected"):
            self.acked_after_end(lease.lease_id, ended.acked)

    def acked_after_end(self, lease_id: int, rows: Iterable[int]) -> None:
        """``rows`` count as acked under the ended lease ``lease_id`` (a repeat is harmless)."""
        if lease_id not in self._partly_acked and len(self._partly_acked) >= PARTLY_ACKED_LIMIT:
            del self._partly_acked[next(iter(self._partly_acked))]
        self._partly_acked[lease_id] = self._partly_acked.get(lease_id, frozenset()) | set(rows)

    def acked_before_end(self, lease_id: int) -> frozenset[int]:
        """The rows acked under an expired or given-up lease before it ended (empty: none, or
        forgotten)."""
        return self._partly_acked.get(lease_id, frozenset())

    def status(self, lease_id: int) -> Literal["active"] | LeaseEnd | None:
        """``"active"``, how the lease ended, or None (never granted, or ended too long ago)."""
        return "active" if lease_id in self._active else self._ended.get(lease_id)

    def where(
        self, *, partition: str | None = None, task: str | None = None, owner: Any = None
    ) -> list[Lease]:
        """The active leases of a partition, a task and/or an owner (a copy: safe to end them
        while going through it)."""
        return [
            lease
            for lease in self._active.values()
            if (partition is None or lease.partition == partition)
            and (task is None or lease.task == task)
            and (owner is None or lease.owner == owner)
        ]

    def forget_rows(self, partition: str, row_ids: set[int]) -> None:
        """Rows of ``partition`` were deleted: they leave their leases, and a lease left without
        rows ends ``"cleared"``."""
        for lease in self.where(partition=partition):
            if lease.rows & row_ids:
                lease.rows -= row_ids
                if not lease.rows:
                    self.end(lease, "cleared")


class Leases:
    """The owner of the lease table: grants leases, and alone ends them — acked, released,
    expired, given up with their reader's connection, reset, or with their partition.
    Consuming a row (its task's marks) happens here too, under the lease that held it."""

    def __init__(
        self, catalog: Catalog, ids: Ids, deadlines: DeadlineHeap, lease_timeout: float
    ) -> None:
        self.catalog = catalog
        self.ids = ids
        self.deadlines = deadlines
        self.lease_timeout = lease_timeout
        self.table = LeaseTable()
        catalog.on_evict.append(self.table.forget_rows)

    def grant(self, p: Partition, req: GetMeta, rows: list[int], owner: Any, now: float) -> int:
        """Lease ``rows`` of ``p`` to ``req.task`` for the get ``req``; returns the lease id."""
        lease_id = next(self.ids)
        p.tasks.lease(req.task, rows, lease_id)
        lease = Lease(
            lease_id,
            p.name,
            req.task,
            set(rows),
            now + (req.lease_timeout or self.lease_timeout),
            req.current_version,
            req.measure,
            owner,
        )
        self.table.grant(lease)
        self.deadlines.add(lease.deadline, "lease", lease_id)
        return lease_id

    def ack(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], tokens_masked: int = 0,
        resumed: bool = False,
    ) -> tuple[int, Effects]:  # fmt: skip
        effects = Effects()
        lease, p = self._lease_for(partition, task, lease_id, row_ids, resumed)
        if lease is None or p is None:
            return 0, effects
        rows = [r for r in row_ids if r in lease.rows]
        n = p.tasks.ack(task, rows)
        if n:
            p.tasks.task(task).tokens_masked += tokens_masked
        lease.rows.difference_update(rows)
        if lease.rows and rows:  # a partial ack: remembered, so that repeating it stays harmless
            lease.acked = set(rows) if lease.acked is None else lease.acked | set(rows)
        if lease.current_version is not None:
            hist = p.tasks.task(task).lag
            for rid in rows:
                v = version_of(p.rows[rid], lease.measure)
                if v is not None:
                    lag = lease.current_version - v
                    hist[lag] = hist.get(lag, 0) + 1
        if not lease.rows:
            self.table.end(lease, "acked")
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
        n = p.tasks.release(task, rows)
        lease.rows.difference_update(rows)
        if not lease.rows:
            self.table.end(lease, "released")
        effects.touched.add(partition)
        return n, effects

    def _lease_for(
        self, partition: str, task: str, lease_id: int, row_ids: list[int], resumed: bool = False
    ) -> tuple[Lease | None, Partition | None]:
        """The active lease, or None when the call is a harmless repeat; raises otherwise.
        ``resumed``: the ack of a batch a checkpoint trained on, whose lease may have ended
        since (the trainer died): see :meth:`_reclaim`."""
        p = self.catalog.partitions.get(partition)
        lease = self.table.get(lease_id)
        if lease is not None and (lease.task != task or lease.partition != partition):
            raise UnknownLeaseError(
                f"lease {lease_id} belongs to task {lease.task!r} of partition "
                f"{lease.partition!r}, not to task {task!r} of {partition!r}",
                lease_id=lease_id,
            )
        status = self.table.status(lease_id)
        if status is None:
            raise UnknownLeaseError(
                f"lease {lease_id} is unknown to this controller (never granted, or granted by a "
                f"controller that has since restarted); get the rows again with get_meta",
                lease_id=lease_id,
            )
        if p is None or status in ("cleared", "reset") or lease_id < p.born:
            return None, None
        before = self.table.acked_before_end(lease_id)
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
        p.tasks.lease(task, live, claim)
        lease = Lease(claim, p.name, task, set(live), 0.0)
        self.table.grant(lease)  # acked at once by the caller, on behalf of the ended lease:
        self.table.acked_after_end(lease_id, live)  # repeating this ack is harmless
        return lease

    def expire(self, lease_id: int, deadline: float) -> str | None:
        """A lease's deadline came: its rows not acked go back to available. Returns its
        partition (whose parked gets may be served now), None when the lease ended before."""
        lease = self.table.get(lease_id)
        if lease is None or lease.deadline != deadline:
            return None
        self.catalog.partitions[lease.partition].tasks.release(lease.task, sorted(lease.rows))
        self.table.end(lease, "expired")
        return lease.partition

    def reset(self, partition: str, task: str) -> None:
        """``task``'s consumption of ``partition`` is reset: its leases end."""
        for lease in self.table.where(partition=partition, task=task):
            self.table.end(lease, "reset")

    def drop_peer(self, peer: Any, effects: Effects) -> None:
        """The reader ``peer`` went away: its leased rows go back to available."""
        for lease in self.table.where(owner=peer):
            p = self.catalog.partitions.get(lease.partition)
            if p is not None:
                p.tasks.release(lease.task, sorted(lease.rows))
                effects.touched.add(p.name)
            self.table.end(lease, "disconnected")

    def partition_cleared(self, partition: str) -> None:
        for lease in self.table.where(partition=partition):
            self.table.end(lease, "cleared")
