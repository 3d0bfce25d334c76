"""The put book: the puts in flight, how the newest ended ones ended, the puts waiting for room
under a quota and the copies of replicated one-exchange puts waiting for the other. Its owner is
:class:`~tqstream.controller.puts.Puts`, which alone opens, ends and parks puts."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, get_args

from tqstream.controller.records import Ledger, PutEnd
from tqstream.protocol.messages import PreparePut


@dataclasses.dataclass
class PendingPut:
    put_id: int
    partition: str
    ids: Sequence[int]  # its rows (a range for a put's new rows)
    mask: int
    fields: list[str]
    chunks: list[tuple[int, int]]  # (unit, chunk)
    new_rows: bool  # a put (True) or a put_fields (False)
    per_row: int  # bytes per row, for the units' load estimate
    cancelled: bool = False  # its partition was cleared: only its chunks remain to drop
    rejected: int = 0  # rows the producer refused; counted when the put commits, like produced
    owner: Any = None  # the producer's peer: its put is aborted when it disconnects
    # a put_fields by key: the rows it creates (committed with its fields, or removed with it)
    created: set[int] = dataclasses.field(default_factory=set)
    tags: list[Any] | None = None  # per row of ``ids``, tags merged in at the commit
    shapes: dict[str, Any] | None = None  # the TransferQueue layer's record (RowShapes by field)
    keyed: bool = False  # a put_fields by key: its commit answers with the rows' metadata
    versions: tuple[list[int | None], list[int | None]] | None = None  # (starts, ends) per row
    overwrite: bool = False  # its chunks are published to the units at the commit
    units: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # put_fields: per row


class WaitingPut(NamedTuple):
    """A put waiting for room under a quota: its request, since when it waits, and the unit it
    was stored on first (a direct put; None for a placed one)."""

    req: PreparePut
    since: float
    pinned: int | None


class Half(NamedTuple):
    """One copy of a replicated one-exchange put (``PreparePut.pair``), held by ``unit``, waiting
    for the other; ``handle`` answers it."""

    req: PreparePut
    unit: int
    handle: Any


class PutBook(Ledger[PendingPut, PutEnd]):
    """The puts in flight (prepared, neither committed nor rolled back: a read-only mapping of
    id to :class:`PendingPut`), how the newest ended ones ended, and the puts waiting for room
    under a quota. A put starts only by :meth:`open` and ends only by :meth:`end`."""

    def __init__(self) -> None:
        super().__init__(get_args(PutEnd))
        self._waiting: dict[Any, WaitingPut] = {}  # by request handle, in arrival order
        self._halves: dict[int, Half] = {}  # by pair token

    def open(self, put: PendingPut) -> None:
        self._start(put.put_id, put)

    def end(self, put_id: int, status: PutEnd) -> PendingPut | None:
        """The put ends (``status`` answers a late commit or abort): the put, or None when it was
        not in flight (ending it again is a no-op)."""
        return self._finish(put_id, status)

    def status(self, put_id: int) -> Literal["pending"] | PutEnd | None:
        """``"pending"``, how the put ended, or None (never opened, or ended too long ago)."""
        return "pending" if put_id in self._active else self._ended.get(put_id)

    def where(
        self, *, partition: str | None = None, owner: Any = None, unit: int | None = None,
        live: bool = False,
    ) -> list[PendingPut]:  # fmt: skip
        """The puts in flight of a partition, an owner, with a chunk on a unit and/or (``live``)
        whose partition was not cleared since (a copy: safe to end them while going through it)."""
        return [
            put
            for put in self._active.values()
            if (partition is None or put.partition == partition)
            and (owner is None or put.owner == owner)
            and (unit is None or any(u == unit for u, _ in put.chunks))
            and not (live and put.cancelled)
        ]

    def fields_in_flight(self, partition: str) -> set[str]:
        """The fields the live puts in flight to ``partition`` write."""
        return {f for put in self.where(partition=partition, live=True) for f in put.fields}

    # --- waiting for room ---
    def park(self, handle: Any, waiting: WaitingPut) -> None:
        self._waiting[handle] = waiting

    def unpark(self, handle: Any) -> WaitingPut | None:
        """Stop the wait of ``handle``'s put: how it waited, None when it does not wait."""
        return self._waiting.pop(handle, None)

    def parked(self, handle: Any) -> WaitingPut | None:
        return self._waiting.get(handle)

    def waiting(self) -> list[tuple[Any, WaitingPut]]:
        """The waiting puts by handle, in arrival order (a copy)."""
        return list(self._waiting.items())

    # --- one copy of a replicated put, waiting for the other ---
    def hold_half(self, token: int, half: Half) -> None:
        self._halves[token] = half

    def take_half(self, token: int) -> Half | None:
        return self._halves.pop(token, None)

    def holds_half(self, token: int) -> bool:
        return token in self._halves

    def halves_with(self, unit: int) -> list[tuple[int, Half]]:
        """The waiting copies held by ``unit`` or waiting for a copy from it (a copy)."""
        return [
            (token, half)
            for token, half in self._halves.items()
            if unit in (half.req.pair.units if half.req.pair is not None else (half.unit,))
        ]
