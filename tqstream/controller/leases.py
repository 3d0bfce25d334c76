"""Leases: the batches granted to readers and not yet acked, released, expired or given up, and
how the newest ended ones ended."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Literal, get_args

from tqstream.controller.records import LeaseEnd, Ledger
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
