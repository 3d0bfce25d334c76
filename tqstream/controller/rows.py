"""A partition's rows as columns: one array per attribute, indexed by row id.

Row ids of a partition are handed out in order and never reused, so the rows live at ``row id -
base`` of every column; rows removed leave a hole (state 0) and the columns drop their oldest
holes from time to time (:meth:`Rows.trim`), so memory follows the rows held, not the rows ever
put. A held row costs ~45 bytes here (state, written fields, unit, replica, bytes, three versions,
ready sequence, group) instead of a Python object, a dict entry and their integers. Rare
attributes (a user's key, tags, the record of a second write, the fields of a ``put_fields`` in
flight) are kept in dicts of the rows that have them.

:class:`Row` is a cursor over one row (made on demand, two slots) for code that reads or sets a
few attributes of a few rows; bulk work goes through the columns.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from tqstream.errors import InvalidRequestError
from tqstream.staleness import MAX_VERSION

SMALL = 64
"""Up to this many rows, bulk operations go row by row (numpy's call costs more)."""

PENDING, COMMITTED = 1, 2

_DTYPES = {"b": np.int8, "h": np.int16, "i": np.int32, "q": np.int64, "Q": np.uint64}
"""Row states (0: no row: never made here, or removed)."""

NO_VERSION = -(2**31)
"""A version column's None (versions are 32-bit; see :func:`check_versions`)."""

VERSION_MIN, VERSION_MAX = -MAX_VERSION, MAX_VERSION


def masks(n: int) -> array:
    return array("Q", bytes(8 * n))


class Rows:
    """The rows of one partition, pending and committed, by id."""

    def __init__(self, first: int = 0) -> None:
        self.base = first  # the row id at index 0 of every column
        self.state = bytearray()  # 0 none, PENDING, COMMITTED
        # the fields written, as the partition's bits; a list of ints past 64 fields
        self.written: array | list[int] = masks(0)
        self.unit = array("h")
        self.replica = array("h")  # the unit holding the second copy; -1: none
        self.nbytes = array("q")
        self.vstart = array("i")
        self.vend = array("i")
        self.vdisp = array("i")
        self.seq = array("q")  # when its one write happened (see writes)
        self.group = array("i")  # the partition's number of its group; -1: none
        self.live = 0  # rows in state PENDING or COMMITTED
        self.lead = 0  # no row before this position (see holes)
        self.group_names: dict[int, str] = {}  # group number -> name (Partition.groups)
        self.named: dict[int, str] = {}  # row -> the user's key (generated keys are not stored)
        self.tags: dict[int, dict[str, Any]] = {}
        self.pending: dict[int, int] = {}  # row -> fields of a put_fields in flight
        # row -> (mask, seq) of each committed write, once it has more than one
        self.writes: dict[int, list[tuple[int, int]]] = {}

    # --- membership ---
    def __len__(self) -> int:
        return self.live

    def __contains__(self, rid: object) -> bool:
        i = rid - self.base  # type: ignore[operator]
        return 0 <= i < len(self.state) and self.state[i] != 0

    def __getitem__(self, rid: int) -> Row:
        if rid not in self:
            raise KeyError(rid)
        return Row(self, rid)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def get(self, rid: int) -> Row | None:
        return Row(self, rid) if rid in self else None

    def committed(self, rid: int) -> bool:
        i = rid - self.base
        return 0 <= i < len(self.state) and self.state[i] == COMMITTED

    def ids(self, state: int | None = None) -> list[int]:
        """The ids of the rows held (``state``: of that state only), in id order."""
        s = np.frombuffer(self.state, np.uint8)
        idx = np.flatnonzero(s if state is None else s == state)
        return (idx + self.base).tolist()

    def values(self, state: int | None = None) -> list[Row]:
        return [Row(self, rid) for rid in self.ids(state)]

    def items(self) -> list[tuple[int, Row]]:
        return [(rid, Row(self, rid)) for rid in self.ids()]

    # --- growth ---
    def add(self, n: int, version: int | None) -> range:
        """``n`` new pending rows, without a unit yet, all of ``version``; returns their ids."""
        first = self.base + len(self.state)
        self.state.extend(bytes([PENDING]) * n)
        self._pad(n, version)
        self.live += n
        return range(first, first + n)

    def skip_to(self, first: int) -> None:
        """The next row made gets id ``first`` (ids below it are never used here)."""
        end = self.base + len(self.state)
        if first < end:
            raise ValueError(f"row ids up to {end - 1} are taken")
        if not self.live:
            self.trim(len(self.state))
            self.base = first
            return
        self.state.extend(bytes(first - end))
        self._pad(first - end, None)

    def extend_to(self, end: int) -> None:
        """Ids up to ``end`` exist in the columns (as holes: no row)."""
        n = end - self.base - len(self.state)
        if n > 0:
            self.state.extend(bytes(n))
            self._pad(n, None)

    def _pad(self, n: int, version: int | None) -> None:
        zeros = bytes(8 * n)
        if isinstance(self.written, array):
            self.written.frombytes(zeros)
        else:
            self.written.extend([0] * n)
        minus = array("h", [-1]) * n
        self.unit.extend(minus)
        self.replica.extend(minus)
        self.nbytes.frombytes(zeros)
        self.seq.frombytes(zeros)
        vs = array("i", [NO_VERSION if version is None else version]) * n
        self.vstart.extend(vs)
        self.vend.extend(vs)
        self.vdisp.extend(vs)
        self.group.extend(array("i", [-1]) * n)

    def widen(self) -> None:
        """The partition has more than 64 fields: written masks become Python ints."""
        if isinstance(self.written, array):
            self.written = self.written.tolist()

    def columns(self) -> list[Any]:
        return [self.state, self.written, self.unit, self.replica, self.nbytes, self.vstart,
                self.vend, self.vdisp, self.seq, self.group]  # fmt: skip

    def remove_few(self, ids: list[int]) -> None:
        """Remove rows ``ids`` (rows, no repeats)."""
        state, base = self.state, self.base
        for rid in ids:
            state[rid - base] = 0
        self.live -= len(ids)
        for extra in (self.named, self.tags, self.pending, self.writes):
            if extra:
                for rid in ids:
                    extra.pop(rid, None)

    def positions(self, ids: Iterable[int]) -> np.ndarray:
        """The column positions of those of ``ids`` that are rows here (pending or committed),
        without repeats, in the order given."""
        if isinstance(ids, range):
            a = max(ids.start - self.base, 0)
            b = min(ids.stop - self.base, len(self.state))
            idx = np.arange(a, max(a, b), dtype=np.int64)
        else:
            idx = np.fromiter(ids, np.int64) - self.base
            idx = idx[(idx >= 0) & (idx < len(self.state))]
            if len(idx) > 1:
                _, first = np.unique(idx, return_index=True)
                if len(first) < len(idx):
                    idx = idx[np.sort(first)]
        return idx[np.frombuffer(self.state, np.uint8)[idx] != 0]

    def remove_all(self, idx: np.ndarray) -> None:
        """Remove the rows at column positions ``idx`` (rows, no repeats)."""
        np.frombuffer(self.state, np.uint8)[idx] = 0
        self.live -= len(idx)
        for extra in (self.named, self.tags, self.pending, self.writes):
            if extra:
                for rid in extra.keys() & set((idx + self.base).tolist()):
                    del extra[rid]

    def on_units(self, ids: Sequence[int]) -> tuple[dict[int, int], dict[int, list[int]]]:
        """The bytes rows ``ids`` hold on each unit (their replicas' too), and the rows each unit
        holds (a row on two units is listed under both)."""
        if len(ids) <= SMALL:
            return self._on_units_few(ids)
        idx = np.fromiter(ids, np.int64, len(ids)) - self.base
        nbytes = np.frombuffer(self.nbytes, np.int64)[idx]
        charges: dict[int, int] = {}
        holds: dict[int, list[int]] = {}
        for col in (self.unit, self.replica):
            units = np.frombuffer(col, np.int16)[idx]
            for u in np.unique(units).tolist():
                if u < 0:
                    continue
                mine = units == u
                charges[u] = charges.get(u, 0) + int(nbytes[mine].sum())
                holds.setdefault(u, []).extend((idx[mine] + self.base).tolist())
        return charges, holds

    def _on_units_few(self, ids: Sequence[int]) -> tuple[dict[int, int], dict[int, list[int]]]:
        charges: dict[int, int] = {}
        holds: dict[int, list[int]] = {}
        base, unit, replica, nbytes = self.base, self.unit, self.replica, self.nbytes
        for rid in ids:
            i = rid - base
            for u in (unit[i], replica[i]):
                if u >= 0:
                    charges[u] = charges.get(u, 0) + nbytes[i]
                    holds.setdefault(u, []).append(rid)
        return charges, holds

    def on_unit(self, u: int) -> np.ndarray:
        """The ids of the rows with a copy on unit ``u``, ascending."""
        live = np.frombuffer(self.state, np.uint8) != 0
        here = np.frombuffer(self.unit, np.int16) == u
        here |= np.frombuffer(self.replica, np.int16) == u
        return np.flatnonzero(live & here) + self.base

    def lose_unit(self, u: int) -> list[int]:
        """Unit ``u`` is gone: rows with a copy elsewhere are served from it from now on.
        Returns the rows it held the only copy of."""
        live = np.frombuffer(self.state, np.uint8) != 0
        unit = np.frombuffer(self.unit, np.int16)
        replica = np.frombuffer(self.replica, np.int16)
        replica[live & (replica == u)] = -1
        mine = live & (unit == u)
        copied = mine & (replica >= 0)
        unit[copied] = replica[copied]
        replica[copied] = -1
        return (np.flatnonzero(mine & ~copied) + self.base).tolist()

    def holes(self) -> int:
        """How many ids at the start of the columns hold no row."""
        state, lead, n = self.state, self.lead, len(self.state)
        while lead < n and not state[lead]:  # rows are made at the end only: lead only grows
            lead += 1
        self.lead = lead
        return lead

    def trim(self, k: int) -> None:
        """Drop the first ``k`` ids of every column (they hold no row)."""
        if k <= 0:
            return
        for col in self.columns():
            del col[:k]
        self.base += k
        self.lead = max(self.lead - k, 0)

    # --- one row's attributes ---
    def set_version(self, col: array, rid: int, v: int | None) -> None:
        col[rid - self.base] = NO_VERSION if v is None else v

    def versions(self, col: array, idx: Sequence[int] | np.ndarray) -> list[int | None]:
        if isinstance(idx, np.ndarray) or (isinstance(idx, range) and len(idx) > SMALL):
            whole = np.frombuffer(col, np.int32)
            part = whole[idx] if isinstance(idx, np.ndarray) else whole[idx.start : idx.stop]
            none = part == NO_VERSION
            if none.all():
                return [None] * len(part)
            if not none.any():
                return part.tolist()  # type: ignore[no-any-return]
        vs = self.column(col, idx)
        if NO_VERSION in vs:
            return [None if v == NO_VERSION else v for v in vs]
        return vs  # type: ignore[return-value]

    def column(self, col: array | list[int], idx: Sequence[int] | np.ndarray) -> list[int]:
        """The values of ``col`` at column positions ``idx``."""
        if isinstance(idx, range):
            part = col[idx.start : idx.stop]
            return part.tolist() if isinstance(part, array) else part
        if isinstance(idx, np.ndarray):
            if isinstance(col, array):
                return np.frombuffer(col, _DTYPES[col.typecode])[idx].tolist()  # type: ignore[no-any-return]
            return [col[i] for i in idx.tolist()]
        return [col[i] for i in idx]

    def runs(self, col: array, idx: range) -> list[int]:
        """``col`` over positions ``idx`` as runs: value, count, value, count, ..."""
        part = np.frombuffer(col, _DTYPES[col.typecode])[idx.start : idx.stop]
        if not len(part):
            return []
        starts = np.flatnonzero(np.diff(part)) + 1
        bounds = np.concatenate(([0], starts, [len(part)]))
        out = np.empty(2 * (len(bounds) - 1), np.int64)
        out[0::2], out[1::2] = part[bounds[:-1]], np.diff(bounds)
        return out.tolist()  # type: ignore[no-any-return]

    def uniform(self, col: array, idx: range) -> tuple[bool, int | None]:
        """Whether the version column ``col`` holds one value over positions ``idx``, and it."""
        part = np.frombuffer(col, np.int32)[idx.start : idx.stop]
        v = int(part[0])
        if not (part == v).all():
            return False, None
        return True, None if v == NO_VERSION else v

    def plain(self, ids: range) -> bool:
        """Rows ``ids`` have generated keys, no tags and no group."""
        for rare in (self.named, self.tags):
            if rare and (len(rare) > len(ids) or any(rid in ids for rid in rare)):
                return False
        if self.group_names:
            b = self.base
            group = np.frombuffer(self.group, np.int32)[ids.start - b : ids.stop - b]
            return bool((group < 0).all())
        return True

    def committed_ids(self, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` that are committed rows, in order."""
        if len(ids) <= SMALL:
            return [rid for rid in ids if self.committed(rid)]
        arr = np.asarray(ids, np.int64)
        idx = arr - self.base
        ok = (idx >= 0) & (idx < len(self.state))
        ok[ok] = np.frombuffer(self.state, np.uint8)[idx[ok]] == COMMITTED
        return arr[ok].tolist()  # type: ignore[no-any-return]

    def groups(self, idx: Sequence[int] | np.ndarray) -> list[str | None]:
        if not self.group_names:
            return [None] * len(idx)
        names = self.group_names
        return [None if g < 0 else names[g] for g in self.column(self.group, idx)]

    def index(self, ids: Sequence[int]) -> Sequence[int] | np.ndarray:
        """Column positions of ``ids``: a range for a range (one slice), a list for a few, else
        an array."""
        b = self.base
        if len(ids) > SMALL and not isinstance(ids, range):
            return np.asarray(ids, np.int64) - b
        if isinstance(ids, range):
            return range(ids.start - b, ids.stop - b)
        return [rid - b for rid in ids]


def check_versions(vs: Iterable[int | None] | None, what: str) -> None:
    """Versions are policy versions, kept as 32-bit integers: refuse others (from a peer that
    skipped the client's check, or derived from per-token versions out of range)."""
    if vs is None:
        return
    for v in vs:
        if v is not None and not VERSION_MIN <= v <= VERSION_MAX:
            raise InvalidRequestError(
                f"{what} {v} is outside the versions tqstream keeps "
                f"({VERSION_MIN}..{VERSION_MAX}): versions are policy versions (training steps), "
                f"not timestamps",
                **{what: v},
            )


class Row:
    """One row of a :class:`Rows` table: reads and writes its columns."""

    __slots__ = ("id", "t")

    def __init__(self, t: Rows, rid: int) -> None:
        self.t = t
        self.id = rid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Row) and other.t is self.t and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"Row({self.id})"

    @property
    def committed(self) -> bool:
        return self.t.state[self.id - self.t.base] == COMMITTED

    @property
    def group(self) -> str | None:
        g = self.t.group[self.id - self.t.base]
        return None if g < 0 else self.t.group_names[g]

    @property
    def written(self) -> int:
        return self.t.written[self.id - self.t.base]

    @property
    def ready_seq(self) -> int:
        return self.t.seq[self.id - self.t.base]

    @property
    def unit(self) -> int:
        return self.t.unit[self.id - self.t.base]

    @unit.setter
    def unit(self, u: int) -> None:
        self.t.unit[self.id - self.t.base] = u

    @property
    def replica(self) -> int:
        return self.t.replica[self.id - self.t.base]

    @replica.setter
    def replica(self, u: int) -> None:
        self.t.replica[self.id - self.t.base] = u

    @property
    def nbytes(self) -> int:
        return self.t.nbytes[self.id - self.t.base]

    @nbytes.setter
    def nbytes(self, n: int) -> None:
        self.t.nbytes[self.id - self.t.base] = n

    @property
    def version_start(self) -> int | None:
        v = self.t.vstart[self.id - self.t.base]
        return None if v == NO_VERSION else v

    @version_start.setter
    def version_start(self, v: int | None) -> None:
        self.t.set_version(self.t.vstart, self.id, v)

    @property
    def version_end(self) -> int | None:
        v = self.t.vend[self.id - self.t.base]
        return None if v == NO_VERSION else v

    @version_end.setter
    def version_end(self, v: int | None) -> None:
        self.t.set_version(self.t.vend, self.id, v)

    @property
    def dispatch_version(self) -> int | None:
        v = self.t.vdisp[self.id - self.t.base]
        return None if v == NO_VERSION else v

    @dispatch_version.setter
    def dispatch_version(self, v: int | None) -> None:
        self.t.set_version(self.t.vdisp, self.id, v)

    @property
    def pending(self) -> int:
        return self.t.pending.get(self.id, 0)

    @pending.setter
    def pending(self, mask: int) -> None:
        if mask:
            self.t.pending[self.id] = mask
        else:
            self.t.pending.pop(self.id, None)

    @property
    def key(self) -> str | None:
        """The user's key; None: generated from the id (``Partition.key_of``)."""
        return self.t.named.get(self.id)

    @property
    def tags(self) -> dict[str, Any] | None:
        return self.t.tags.get(self.id)

    @property
    def writes(self) -> list[tuple[int, int]] | None:
        """(mask, seq) of each committed write; None while it has at most one, which is then
        (written, ready_seq)."""
        return self.t.writes.get(self.id)

    def merge_tags(self, tags: dict[str, Any] | None) -> None:
        """Tags are merged key by key: a later write of ``{"status": ...}`` keeps the others."""
        if tags:
            mine = self.t.tags.get(self.id)
            if mine is None:
                self.t.tags[self.id] = dict(tags)
            else:
                mine.update(tags)
