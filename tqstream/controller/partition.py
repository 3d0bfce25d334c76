"""One partition's metadata: schemas, the production matrix, groups and per-task consumption.

Pure state, no I/O. Rows are created *pending* by a prepared put (keys and group slots reserved,
invisible to readers) and become visible at commit; ``written`` is the row's bitmask of committed
fields (the production matrix), ``pending`` the bits of an in-flight ``put_fields``.

The rows themselves are columns (``rows.py``). Per task a committed row is *available*,
*leased* (``TaskState.leased``: row -> lease, the rows of live leases only) or *acked* (a byte per
row, ``TaskState.acked``). Every transition goes through :meth:`Partition.lease`, :meth:`ack`,
:meth:`release`, :meth:`commit_rows`, :meth:`commit_fields` and :meth:`remove_rows`, which keep
every view (see ``views.py``) exact, so selection never rescans.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence, Set

import numpy as np

from tqstream.controller.rows import COMMITTED, NO_VERSION, SMALL, Row, Rows
from tqstream.controller.shapes import Shapes
from tqstream.controller.views import GroupKey, GroupView, ReadyView
from tqstream.errors import (
    DuplicateKeyError,
    GroupError,
    SchemaError,
    UnknownFieldError,
    UnknownKeyError,
)
from tqstream.types import FieldSchema, TaskStats

TRIM_MIN = 4096
"""The columns drop their leading holes once there are this many and they are the larger half."""


class Group:
    __slots__ = ("fields", "members", "number", "size")

    def __init__(self, size: int, fields: frozenset[str], number: int = -1) -> None:
        self.size = size
        self.number = number  # its number in the rows' group column
        self.fields = fields  # what its first put wrote; every member is put with the same
        self.members: list[int] = []


class Acked(Set[int]):
    """The rows a task acked (and that live): a byte per row of the partition."""

    __slots__ = ("t",)

    def __init__(self, t: TaskState) -> None:
        self.t = t

    @classmethod
    def _from_iterable(cls, it: Iterable[int]) -> set[int]:  # type: ignore[override]
        return set(it)

    def __contains__(self, rid: object) -> bool:
        t = self.t
        i = rid - t.base  # type: ignore[operator]
        return 0 <= i < len(t.marks) and t.marks[i] != 0

    def __iter__(self) -> Iterator[int]:
        t = self.t
        return iter((np.flatnonzero(np.frombuffer(t.marks, np.uint8)) + t.base).tolist())

    def __len__(self) -> int:
        return self.t.n_acked


class TaskState:
    __slots__ = ("base", "consumed", "lag", "leased", "lost", "marks", "n_acked",
                 "stale_dropped", "tokens_masked")  # fmt: skip

    def __init__(self, base: int = 0) -> None:
        self.leased: dict[int, int] = {}  # row -> lease id
        self.base = base  # the row id of marks[0] (the partition's rows' base)
        self.marks = bytearray()  # row - base -> 1: acked
        self.n_acked = 0
        self.consumed = 0  # rows acked, ever (acked rows leave ``acked`` once freed)
        self.stale_dropped = 0
        self.lost = 0  # rows lost with a storage unit before this task acked them
        self.lag: dict[int, int] = {}  # version lag at ack -> rows
        self.tokens_masked = 0  # generated tokens acked outside a token-measure window

    @property
    def acked(self) -> Acked:
        return Acked(self)

    def is_acked(self, rid: int) -> bool:
        i = rid - self.base
        return 0 <= i < len(self.marks) and self.marks[i] != 0

    def extend_marks(self, rid: int) -> None:
        """Row ``rid`` has a mark."""
        n = rid - self.base + 1 - len(self.marks)
        if n > 0:
            self.marks.extend(bytes(n))

    def mark_acked(self, rid: int) -> None:
        i = rid - self.base
        self.extend_marks(rid)
        if not self.marks[i]:
            self.marks[i] = 1
            self.n_acked += 1

    def unmark(self, rid: int) -> None:
        i = rid - self.base
        if 0 <= i < len(self.marks) and self.marks[i]:
            self.marks[i] = 0
            self.n_acked -= 1

    def unmark_all(self, ids: np.ndarray) -> None:
        """The rows ``ids`` (live) are gone."""
        idx = ids - self.base
        idx = idx[(idx >= 0) & (idx < len(self.marks))]
        marks = np.frombuffer(self.marks, np.uint8)
        self.n_acked -= int(np.count_nonzero(marks[idx]))
        marks[idx] = 0

    def set_acked(self, rows: Iterable[int]) -> None:
        self.marks = bytearray()
        self.n_acked = 0
        for rid in rows:
            self.mark_acked(rid)

    def clear(self) -> None:
        self.leased.clear()
        self.marks = bytearray()
        self.n_acked = 0

    def trim(self, k: int) -> None:
        del self.marks[:k]
        self.base += k


class Partition:
    def __init__(self, name: str, key_prefix: str) -> None:
        self.name = name
        self.key_prefix = key_prefix
        self.schemas: dict[str, FieldSchema] = {}
        self.bits: dict[str, int] = {}  # field -> bit in Row.written
        self.written_count: dict[str, int] = {}  # field -> committed rows having it
        # schemas fixed by writes still in flight only: forgotten if all of those roll back
        self.provisional: set[str] = set()
        self.rows = Rows()
        # keys are generated from row ids (key_of) and not stored, except the users' keys and the
        # generated ones a user key took the name of: those are here, and in rows.named
        self._named: dict[str, int] = {}
        self._taken: set[int] = set()  # rows to come whose generated name a user key took
        self.groups: dict[str, Group] = {}
        self._group_number = 0
        self.tasks: dict[str, TaskState] = {}
        self.views: dict[tuple[str, int], ReadyView] = {}
        self.group_views: dict[tuple[str, int], GroupView] = {}
        self.seq = 0
        self.committed = 0
        self.born = 0  # set by the controller: the id counter's value at creation
        self.registered: list[str] = []  # a row all of these tasks acked is freed
        self.ttl: float | None = None
        self.admission: str | None = None  # a capacity admission gets stale evictions back
        self.produced = self.rejected = self.stale_dropped = self.expired = self.freed = 0
        self.lost = 0  # rows lost with a storage unit that held their only copy
        self.replicas: int | None = None  # copies of each row; None: the controller's default
        self.stale_seen: list[int] = []  # filled by select() under a staleness window
        self.producers = 1  # close_partition calls that close it
        self.closes = 0
        self.shapes = Shapes()  # fields put through the TransferQueue layer: their rows' shapes

    @property
    def next_row(self) -> int:
        """The id the next row made gets."""
        return self.rows.base + len(self.rows.state)

    @next_row.setter
    def next_row(self, first: int) -> None:
        """Only before any row, task or view (a partition re-created, or restored)."""
        assert not self.tasks and not self.views and not self.group_views
        self.rows.skip_to(first)

    @property
    def closed(self) -> bool:
        """Every declared producer closed it: no new rows will come (fields still may)."""
        return self.closes >= self.producers

    # --- schemas and fields ---
    def declare(self, fields: Iterable[str]) -> None:
        for f in fields:
            self._bit(f)

    def _bit(self, field: str) -> int:
        bit = self.bits.get(field)
        if bit is None:
            bit = self.bits[field] = 1 << len(self.bits)
            if len(self.bits) > 64:
                self.rows.widen()
        return bit

    def mask_of(self, fields: Sequence[str]) -> int:
        """Bitmask of ``fields``; a field never written nor declared is an error (likely a typo)."""
        mask = 0
        for f in fields:
            bit = self.bits.get(f)
            if bit is None:
                known = ", ".join(repr(k) for k in sorted(self.bits)) or "none"
                raise UnknownFieldError(
                    f"field {f!r} is not in partition {self.name!r} (known fields: {known}); "
                    f"put it first or declare it with create_partition({self.name!r}, "
                    f"fields=[...]) so requests wait for it",
                    field=f,
                    partition=self.name,
                )
            mask |= bit
        return mask

    def check_schemas(self, offered: dict[str, FieldSchema]) -> int:
        """Validate ``offered`` against fixed schemas, fix new ones; returns the fields' mask."""
        for name, schema in offered.items():
            fixed = self.schemas.get(name)
            if fixed is not None and fixed != schema:
                raise SchemaError(
                    f"field {name!r} of partition {self.name!r} is stored as {fixed.describe()} "
                    f"but this write offers {schema.describe()}; convert the data to the stored "
                    f"schema or write it under a new field name",
                    field=name,
                    stored=fixed.describe(),
                    offered=schema.describe(),
                )
        mask = 0
        for name, schema in offered.items():
            if name not in self.schemas:
                self.schemas[name] = schema
                self.provisional.add(name)
            mask |= self._bit(name)
        return mask

    def common_fields(self, rows: Iterable[Row]) -> list[str]:
        """The fields every one of ``rows`` has written, in the order the partition knows them."""
        common = ~0
        written, base = self.rows.written, self.rows.base
        for r in rows:
            common &= written[r.id - base]
        return [f for f, bit in self.bits.items() if common & bit]

    def unknown_keys(self, missing: Sequence[str], asked: int) -> UnknownKeyError:
        shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
        return UnknownKeyError(
            f"{len(missing)} of {asked} keys are not in partition {self.name!r}: {shown}",
            partition=self.name,
            count=len(missing),
            keys=list(missing[:5]),
        )

    def forget_unused_schemas(self, fields: Iterable[str], still_pending: set[str]) -> None:
        """After a write was refused or rolled back: a schema that only writes in flight fixed,
        none of which is left (``still_pending``: their fields), was never written. A schema that
        rows were committed with, or that a checkpoint restored, stays."""
        for f in fields:
            if f in self.provisional and f not in still_pending:
                self.provisional.discard(f)
                self.schemas.pop(f, None)

    # --- rows ---
    def reserve_rows(
        self,
        n: int,
        keys: Sequence[str] | None,
        groups: Sequence[str | None] | None,
        group_size: int | None,
        version: int | None,
        fields: frozenset[str],
    ) -> range:
        """Create ``n`` pending rows of a put of ``fields`` (validated atomically: nothing
        changes on error); returns their ids."""
        if keys is not None:
            seen: set[str] = set()
            dup = []
            for k in keys:
                if k in seen or self.row_of_key(k) is not None:
                    dup.append(k)
                seen.add(k)
            if dup:
                shown = ", ".join(repr(k) for k in dup[:5]) + (" ..." if len(dup) > 5 else "")
                raise DuplicateKeyError(
                    f"{len(dup)} key(s) already exist in partition {self.name!r} or repeat within "
                    f"the put: {shown}; keys must be unique per partition (omit keys to have them "
                    f"generated)",
                    partition=self.name,
                    count=len(dup),
                )
        counts: dict[str, int] = {}
        if groups is not None:
            for g in groups:
                if g is not None:
                    counts[g] = counts.get(g, 0) + 1
            self._check_groups(counts, group_size, fields)
        self.trim()
        ids = self.rows.add(n, version)
        if keys is not None:
            for rid, k in zip(ids, keys, strict=True):
                self.name_row(rid, k)
        elif self._taken:
            for rid in ids:
                if rid in self._taken:
                    self.name_row(rid, None)
        if groups is not None:
            column, base = self.rows.group, self.rows.base
            for rid, g in zip(ids, groups, strict=True):
                if g is not None:
                    grp = self.groups.get(g)
                    if grp is None:
                        grp = self.groups[g] = self.new_group(g, group_size or counts[g], fields)
                    grp.members.append(rid)
                    column[rid - base] = grp.number
        return ids

    def row(self, rid: int) -> Row:
        return Row(self.rows, rid)

    def place(self, ids: range, unit: int, replica: int, nbytes: int | None = None) -> None:
        """Rows ``ids`` (new, consecutive) are stored on ``unit`` (and ``replica``)."""
        t = self.rows
        a, b = ids.start - t.base, ids.stop - t.base
        t.unit[a:b] = array("h", [unit]) * (b - a)
        t.replica[a:b] = array("h", [replica]) * (b - a)
        if nbytes is not None:
            t.nbytes[a:b] = array("q", [nbytes]) * (b - a)

    def set_versions(self, col: array, ids: range, values: Sequence[int | None]) -> None:
        t = self.rows
        a = ids.start - t.base
        col[a : a + len(values)] = array("i", [NO_VERSION if v is None else v for v in values])

    def new_group(self, name: str, size: int, fields: frozenset[str]) -> Group:
        number = self._group_number
        self._group_number += 1
        self.rows.group_names[number] = name
        return Group(size, fields, number)

    def key_of(self, r: Row | int) -> str:
        """Row ``r``'s key: the user's, or generated: ``<prefix><row id>`` (with a suffix if a
        user key took that name first)."""
        rid = r if isinstance(r, int) else r.id
        key = self.rows.named.get(rid)
        return key if key is not None else f"{self.key_prefix}{rid}"

    def keys_of(self, ids: Sequence[int]) -> list[str]:
        keys, prefix = self.rows.named, self.key_prefix
        if not keys:
            return [f"{prefix}{rid}" for rid in ids]
        return [keys.get(rid) or f"{prefix}{rid}" for rid in ids]

    def row_of_key(self, key: str) -> Row | None:
        """The row (pending or committed) whose key is ``key``."""
        rid = self._named.get(key)
        if rid is not None:
            return Row(self.rows, rid)
        rid = self._generated_id(key)
        if rid is None or rid not in self.rows or rid in self.rows.named:
            return None
        return Row(self.rows, rid)

    def name_row(self, rid: int, key: str | None) -> None:
        """Give row ``rid`` (in ``rows``, its key not yet given) the key ``key``, or its generated
        one (None): ``<prefix><row id>``, or with a suffix if a user key took that name."""
        base = f"{self.key_prefix}{rid}"
        if key is None and rid in self._taken:
            self._taken.discard(rid)
            key, n = base, 0
            while (other := self.row_of_key(key)) is not None and other.id != rid:
                n += 1
                key = f"{base}.{n}"
        if key is None or key == base:
            return  # generated: not stored
        self.rows.named[rid] = key
        self._named[key] = rid
        taken = self._generated_id(key)
        if taken is not None and taken >= self.next_row:
            self._taken.add(taken)

    def _generated_id(self, key: str) -> int | None:
        """The row id of a key of the generated form (``<prefix><decimal id>``), else None."""
        if not key.startswith(self.key_prefix):
            return None
        digits = key[len(self.key_prefix) :]
        if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and digits != "0"):
            return None
        return int(digits)

    def _check_groups(
        self, counts: dict[str, int], group_size: int | None, fields: frozenset[str]
    ) -> None:
        """A group built over several puts (one trajectory at a time, from any producer) takes
        members of its size and of its fields only: a member without a field the others have
        would keep a ``whole_groups`` read from ever serving the group."""
        for g, c in counts.items():
            existing = self.groups.get(g)
            size = existing.size if existing is not None else (group_size or c)
            if group_size is not None and group_size != size:
                raise GroupError(
                    f"group {g!r} of partition {self.name!r} was declared with {size} rows but "
                    f"this put declares group_size={group_size}",
                    group=g,
                )
            have = len(existing.members) if existing is not None else 0
            if have + c > size:
                raise GroupError(
                    f"group {g!r} of partition {self.name!r} holds {size} rows at most but this "
                    f"put would make it {have + c}; pass group_size= at the group's first put to "
                    f"build a group over several puts",
                    group=g,
                    size=size,
                    rows=have + c,
                )
            if existing is not None and existing.fields != fields:
                missing, extra = sorted(existing.fields - fields), sorted(fields - existing.fields)
                what = [f"missing {missing}"] if missing else []
                what += [f"extra {extra}"] if extra else []
                raise GroupError(
                    f"group {g!r}: this put's members disagree on fields with the group's earlier "
                    f"members ({', '.join(what)}); every member of a group needs the same "
                    f"fields, or a whole_groups read would wait for the group forever",
                    group=g,
                )

    def commit_rows(self, ids: Sequence[int], mask: int) -> None:
        """Make pending rows visible with the fields of ``mask`` written. Pending rows are new to
        every task and every view, so each view they complete takes them in one update."""
        n = len(ids)
        first = self.seq + 1
        self.seq += n
        self.committed += n
        rows = self.rows
        idx = rows.index(ids)
        if isinstance(idx, range) and isinstance(rows.written, array):
            a, b = idx.start, idx.stop
            rows.state[a:b] = bytes([COMMITTED]) * n
            if n <= SMALL:
                rows.written[a:b] = array("Q", [mask]) * n
                rows.seq[a:b] = array("q", range(first, first + n))
            else:
                np.frombuffer(rows.written, np.uint64)[a:b] = mask
                np.frombuffer(rows.seq, np.int64)[a:b] = np.arange(first, first + n)
        else:
            for seq, i in enumerate(idx, first):
                rows.state[i] = COMMITTED
                rows.written[i] = mask
                rows.seq[i] = seq
        self.count_written(mask, n)
        seqs = range(first, first + n)
        for (_, vmask), v in self.views.items():
            if mask & vmask == vmask:
                v.add_new(ids, seqs)
        for (_, vmask), gv in self.group_views.items():
            if mask & vmask == vmask:
                for rid, seq in zip(ids, seqs, strict=True):
                    key, size = self._group_of(rid)
                    gv.add(key, size, seq)

    def commit_fields(self, rows: Iterable[Row], mask: int) -> None:
        added: dict[int, int] = {}  # fields newly written -> rows (counted once per kind)
        for r in rows:
            r.pending &= ~mask
            bits = mask & ~r.written
            added[bits] = added.get(bits, 0) + 1
            self._write(r.id, mask)
        for bits, n in added.items():
            if bits:
                self.count_written(bits, n)

    def _write(self, rid: int, mask: int) -> None:
        """Fields of ``mask`` written (or, overwritten, written again) for committed row ``rid``;
        the caller counts them (``count_written``)."""
        rows = self.rows
        i = rid - rows.base
        old = rows.written[i]
        writes = rows.writes.get(rid)
        if writes is None and old:  # its one write so far gets a record of its own
            writes = rows.writes[rid] = [(old, rows.seq[i])]
        rows.written[i] = new = old | mask
        self.seq += 1
        rows.seq[i] = seq = self.seq
        if writes is not None:
            writes.append((mask, seq))
        for (task, vmask), v in self.views.items():
            if (old & vmask) != vmask and (new & vmask) == vmask and self.available(rid, task):
                v.add(rid, seq)
        for (task, vmask), gv in self.group_views.items():
            if (old & vmask) != vmask and (new & vmask) == vmask and self.available(rid, task):
                key, size = self._group_of(rid)
                gv.add(key, size, seq)

    def count_written(self, mask: int, n: int) -> None:
        """``n`` more (fewer, when negative) committed rows have the fields of ``mask``."""
        for name, bit in self.bits.items():
            if mask & bit:
                self.written_count[name] = self.written_count.get(name, 0) + n
                if n > 0:
                    self.provisional.discard(name)

    def available(self, r: Row | int, task: str) -> bool:
        """Whether ``task`` may still be served row ``r`` (neither leased nor acked by it)."""
        t = self.tasks.get(task)
        if t is None:
            return True
        rid = r if isinstance(r, int) else r.id
        return rid not in t.leased and not t.is_acked(rid)

    def _ready_seq(self, rid: int, mask: int) -> int:
        """When row ``rid`` became ready for ``mask``: the write of the last of its fields
        (later writes of other fields do not move it)."""
        writes = self.rows.writes.get(rid)
        if writes is None:  # written once (a put's rows)
            return self.rows.seq[rid - self.rows.base]
        return max(seq for m, seq in writes if m & mask)

    @staticmethod
    def writes_of(r: Row) -> list[tuple[int, int]]:
        """The committed writes of ``r``, (fields mask, seq) each, oldest first."""
        writes = r.writes
        if writes is not None:
            return writes
        written = r.written
        return [(written, r.ready_seq)] if written else []

    def _group_seq(self, rid: int, mask: int) -> int:
        """When the group of row ``rid`` (all of its members available) became ready for
        ``mask``."""
        g = self.rows.group[rid - self.rows.base]
        if g < 0:
            return self._ready_seq(rid, mask)
        members = self.groups[self.rows.group_names[g]].members
        return max(self._ready_seq(m, mask) for m in members)

    def _group_of(self, rid: int) -> tuple[GroupKey, int]:
        g = self.rows.group[rid - self.rows.base]
        if g < 0:
            return rid, 1
        name = self.rows.group_names[g]
        return name, self.groups[name].size

    def group_members(self, key: GroupKey) -> list[int]:
        return [key] if isinstance(key, int) else self.groups[key].members

    def remove_rows(self, row_ids: Sequence[int]) -> list[int]:
        """Delete rows (clear or abort); returns the ids of the rows that existed (their
        columns stay readable, e.g. by ``Rows.on_units``, until the next rows are made)."""
        if len(row_ids) <= SMALL:
            return self._remove_few(row_ids)
        rows = self.rows
        idx = rows.positions(row_ids)
        if not len(idx):
            return []
        base = rows.base
        state = np.frombuffer(rows.state, np.uint8)
        committed = idx[state[idx] == COMMITTED]
        if len(committed):
            self.committed -= len(committed)
            if isinstance(rows.written, array):
                masks, counts = np.unique(
                    np.frombuffer(rows.written, np.uint64)[committed], return_counts=True
                )
                for mask, n in zip(masks.tolist(), counts.tolist(), strict=True):
                    self.count_written(mask, -n)
            else:
                for i in committed.tolist():
                    self.count_written(rows.written[i], -1)
        ids = (idx + base).tolist()
        if rows.named:
            for rid in rows.named.keys() & set(ids):
                del self._named[rows.named[rid]]
        if self.group_views:
            written = rows.written
            for (task, vmask), gv in self.group_views.items():
                for i in committed.tolist():
                    if (written[i] & vmask) == vmask and self.available(i + base, task):
                        gkey, size = self._group_of(i + base)
                        gv.remove(gkey, size)
        for v in self.views.values():
            v.forget(idx + base)
        for t in self.tasks.values():
            if t.leased:
                for rid in t.leased.keys() & set(ids):
                    del t.leased[rid]
            if t.n_acked:
                t.unmark_all(idx + base)
        if rows.group_names:
            names = rows.group_names
            groups = np.frombuffer(rows.group, np.int32)[idx]
            for i, g in zip(idx[groups >= 0].tolist(), groups[groups >= 0].tolist(), strict=True):
                name = names[g]
                grp = self.groups[name]
                grp.members.remove(i + base)
                if not grp.members:
                    del self.groups[name]
                    del names[g]
                    for gv in self.group_views.values():
                        gv.forget(name)
        if self.group_views:
            groups = np.frombuffer(rows.group, np.int32)[idx]
            for rid in (idx[groups < 0] + base).tolist():
                for gv in self.group_views.values():
                    gv.forget(rid)
        rows.remove_all(idx)
        if self.shapes:
            self.shapes.forget(ids)
        return ids

    def _remove_few(self, row_ids: Sequence[int]) -> list[int]:
        """``remove_rows`` of a few rows, row by row."""
        rows = self.rows
        base, state, written, end = rows.base, rows.state, rows.written, len(rows.state)
        ids = [rid for rid in dict.fromkeys(row_ids) if 0 <= rid - base < end and state[rid - base]]
        if not ids:
            return ids
        counts: dict[int, int] = {}  # fields mask of committed rows -> how many
        for rid in ids:
            i = rid - base
            if state[i] == COMMITTED:
                w = written[i]
                counts[w] = counts.get(w, 0) + 1
                for (task, vmask), gv in self.group_views.items():
                    if (written[i] & vmask) == vmask and self.available(rid, task):
                        gkey, size = self._group_of(rid)
                        gv.remove(gkey, size)
        if rows.named:
            for rid in ids:
                key = rows.named.get(rid)
                if key is not None:
                    del self._named[key]
        for mask, n in counts.items():
            self.committed -= n
            self.count_written(mask, -n)
        for v in self.views.values():
            v.forget(ids)
        for t in self.tasks.values():
            if t.leased:
                for rid in ids:
                    t.leased.pop(rid, None)
            if t.n_acked:
                marks, tb, tn = t.marks, t.base, len(t.marks)
                for rid in ids:
                    i = rid - tb
                    if 0 <= i < tn and marks[i]:
                        marks[i] = 0
                        t.n_acked -= 1
        group, names = rows.group, rows.group_names
        for rid in ids:
            g = group[rid - base] if names else -1
            if g >= 0:
                name = names[g]
                grp = self.groups[name]
                grp.members.remove(rid)
                if not grp.members:
                    del self.groups[name]
                    del names[g]
                    for gv in self.group_views.values():
                        gv.forget(name)
            else:
                for gv in self.group_views.values():
                    gv.forget(rid)
        rows.remove_few(ids)
        if self.shapes:
            self.shapes.forget(ids)
        return ids

    def trim(self) -> None:
        """Drop the columns' leading ids that hold no row anymore, once they are many."""
        rows = self.rows
        k = rows.holes()
        if k < TRIM_MIN or 2 * k < len(rows.state):
            return
        rows.trim(k)
        base = rows.base
        for t in self.tasks.values():
            t.trim(min(base - t.base, len(t.marks))) if base > t.base else None
            t.base = max(t.base, base)
        for v in self.views.values():
            if base > v.base:
                v.trim(base - v.base)

    # --- consumption ---
    def task(self, name: str) -> TaskState:
        t = self.tasks.get(name)
        if t is None:
            t = self.tasks[name] = TaskState(self.rows.base)
        return t

    def lease(self, task: str, rows: Sequence[int], lease_id: int) -> None:
        t = self.task(task)
        for (vtask, _), v in self.views.items():
            if vtask == task:
                v.remove(rows)
        written, base = self.rows.written, self.rows.base
        for (vtask, vmask), gv in self.group_views.items():
            if vtask == task:
                for rid in rows:
                    if (written[rid - base] & vmask) == vmask:
                        key, size = self._group_of(rid)
                        gv.remove(key, size)
        t.leased.update(dict.fromkeys(rows, lease_id))

    def ack(self, task: str, rows: Iterable[int]) -> int:
        t = self.task(task)
        acked = [rid for rid in rows if t.leased.pop(rid, None) is not None]
        if acked:
            t.extend_marks(max(acked))
            marks, base = t.marks, t.base
            for rid in acked:
                marks[rid - base] = 1
            t.n_acked += len(acked)  # (a leased row is not acked yet)
            t.consumed += len(acked)
        return len(acked)

    def reset(self, task: str) -> int:
        """Every row ``task`` leased or acked is available to it again (its views are rebuilt by
        the next request that needs them: one scan). Returns how many rows that was."""
        t = self.tasks.get(task)
        if t is None:
            return 0
        n = len(t.leased) + t.n_acked
        t.clear()
        t.base = self.rows.base
        for key in [k for k in self.views if k[0] == task]:
            del self.views[key]
        for key in [k for k in self.group_views if k[0] == task]:
            del self.group_views[key]
        return n

    def release(self, task: str, rows: Iterable[int]) -> int:
        t = self.task(task)
        n = 0
        for rid in rows:
            if t.leased.pop(rid, None) is not None:
                self._now_available(rid, task)
                n += 1
        return n

    def _now_available(self, rid: int, task: str) -> None:
        written = self.rows.written[rid - self.rows.base]
        for (vtask, vmask), v in self.views.items():
            if vtask == task and (written & vmask) == vmask:
                v.add(rid, self._ready_seq(rid, vmask))
        for (vtask, vmask), gv in self.group_views.items():
            if vtask == task and (written & vmask) == vmask:
                key, size = self._group_of(rid)
                completes = gv.count.get(key, 0) + 1 == size and key not in gv.seq_of
                seq = (
                    self._group_seq(rid, vmask)
                    if completes
                    else self.rows.seq[rid - self.rows.base]
                )
                gv.add(key, size, seq)

    # --- selection ---
    def _ready_for(self, task: str, mask: int) -> tuple[np.ndarray, np.ndarray]:
        """One-time scan used to build a new view: the committed rows ready for ``mask`` and
        available to ``task``, and when each became ready for it, ordered by that."""
        rows = self.rows
        if isinstance(rows.written, array):
            state = np.frombuffer(rows.state, np.uint8)
            written = np.frombuffer(rows.written, np.uint64)
            ok = (state == COMMITTED) & ((written & np.uint64(mask)) == np.uint64(mask))
            t = self.tasks.get(task)
            if t is not None and t.marks:
                marks = np.frombuffer(t.marks, np.uint8)
                k = t.base - rows.base  # (the task's marks start at or after the rows' base)
                ok[k : k + len(marks)] &= marks[: max(len(ok) - k, 0)] == 0
            idx = np.flatnonzero(ok)
            seqs = np.frombuffer(rows.seq, np.int64)[idx]
            ids = idx + rows.base
            if t is not None and t.leased:
                keep = ~np.isin(ids, np.fromiter(t.leased, np.int64, len(t.leased)))
                ids, seqs = ids[keep], seqs[keep]
            if rows.writes:  # rows written more than once: ready when the mask's last field was
                for j in np.flatnonzero(np.isin(ids, np.fromiter(rows.writes, np.int64))):
                    seqs[j] = self._ready_seq(int(ids[j]), mask)
            if len(seqs) > 1 and not (seqs[1:] >= seqs[:-1]).all():
                order = np.argsort(seqs, kind="stable")
                ids, seqs = ids[order], seqs[order]
            return ids, seqs
        pairs = sorted(
            (self._ready_seq(rid, mask), rid)
            for rid in rows.ids(COMMITTED)
            if (rows.written[rid - rows.base] & mask) == mask and self.available(rid, task)
        )
        return (
            np.array([rid for _, rid in pairs], np.int64),
            np.array([seq for seq, _ in pairs], np.int64),
        )

    def view(self, task: str, mask: int) -> ReadyView:
        v = self.views.get((task, mask))
        if v is None:
            self.task(task)
            v = self.views[(task, mask)] = ReadyView(task, mask, self.rows.base)
            v.add_new(*self._ready_for(task, mask))  # one bulk update
        return v

    def group_view(self, task: str, mask: int) -> GroupView:
        gv = self.group_views.get((task, mask))
        if gv is None:
            self.task(task)
            gv = self.group_views[(task, mask)] = GroupView(task, mask)
            ids, seqs = self._ready_for(task, mask)
            gv.add_new(
                (*self._group_of(rid), seq)
                for rid, seq in zip(ids.tolist(), seqs.tolist(), strict=True)
            )
        return gv

    def select(
        self,
        task: str,
        mask: int,
        batch_size: int,
        whole_groups: bool,
        fresh: Callable[[int], bool] | None = None,
    ) -> list[int] | None:
        """The oldest ``batch_size`` servable rows, or None when there are not enough yet.

        With a staleness window, ``fresh`` says whether a row is inside it; rows (whole groups:
        groups with a member) outside it are skipped and listed in ``self.stale_seen`` for the
        caller to evict or keep. Skipping costs one step per stale row at the head of the order,
        so ``on_stale="drop"`` keeps requests O(batch) while ``"keep"`` pays for what it keeps.
        """
        self.stale_seen = []
        if not whole_groups:
            v = self.view(task, mask)
            if len(v) < batch_size:
                return None
            if fresh is None:
                return v.oldest(batch_size)
            rows: list[int] = []
            for rid in v.rows():
                if fresh(rid):
                    rows.append(rid)
                    if len(rows) == batch_size:
                        return rows
                else:
                    self.stale_seen.append(rid)
            return None
        gv = self.group_view(task, mask)
        if gv.ready_rows < batch_size:
            return None
        picked: list[int] = []
        keys: list[GroupKey] = []
        for key in gv.oldest():
            members = self.group_members(key)
            if fresh is not None and not all(fresh(m) for m in members):
                self.stale_seen.extend(members)
                continue
            keys.append(key)
            if len(picked) + len(members) <= batch_size:
                picked.extend(members)
                if len(picked) == batch_size:
                    return picked
        # Taking every older group that fits can dead-end (a singleton, then only pairs, for 2
        # rows). Take the oldest groups that still leave a way to exactly batch_size rows: the
        # same batch whenever the loop above succeeds, and a batch whenever one exists.
        sizes = [1 if isinstance(k, int) else self.groups[k].size for k in keys]
        full = (1 << (batch_size + 1)) - 1
        reach = [1] * (len(keys) + 1)  # bit n of reach[i]: groups i.. can make exactly n rows
        for i in range(len(keys) - 1, -1, -1):
            reach[i] = (reach[i + 1] | reach[i + 1] << sizes[i]) & full
        if not reach[0] >> batch_size & 1:
            return None
        picked, need = [], batch_size
        for i, key in enumerate(keys):
            if sizes[i] <= need and reach[i + 1] >> (need - sizes[i]) & 1:
                picked.extend(self.group_members(key))
                need -= sizes[i]
                if need == 0:
                    break
        return picked

    def select_rest(
        self, task: str, mask: int, batch_size: int, whole_groups: bool,
        fresh: Callable[[int], bool] | None = None,
    ) -> list[int]:  # fmt: skip
        """The oldest servable rows, up to ``batch_size`` (possibly none): the last, short batch
        of a closed partition. Whole groups only with ``whole_groups``: an incomplete group of a
        closed partition can never be served."""
        if not whole_groups:
            v = self.view(task, mask)
            return [rid for rid in v.rows() if fresh is None or fresh(rid)][:batch_size]
        picked: list[int] = []
        for key in self.group_view(task, mask).oldest():
            members = self.group_members(key)
            if fresh is not None and not all(fresh(m) for m in members):
                continue
            if len(picked) + len(members) <= batch_size:
                picked.extend(members)
        return picked

    def may_serve_more(self, task: str, mask: int) -> bool:
        """Whether rows the task has not consumed could still become servable: rows leased to
        it (a lease may come back) or committed rows it has not consumed that lack some of the
        requested fields (``put_fields`` may add them). A scan: only for closed partitions."""
        t = self.task(task)
        if t.leased:
            return True
        rows = self.rows
        return any(
            (rows.written[rid - rows.base] & mask) != mask and not t.is_acked(rid)
            for rid in rows.ids(COMMITTED)
        )

    # --- reporting ---
    def task_stats(self) -> dict[str, TaskStats]:
        out = {}
        for name, t in self.tasks.items():
            out[name] = TaskStats(
                available=self.committed - len(t.leased) - t.n_acked,
                leased=len(t.leased),
                acked=t.n_acked,
                stale_dropped=t.stale_dropped,
                lag=dict(sorted(t.lag.items())),
                lost=t.lost,
                consumed=t.consumed,
                tokens_masked=t.tokens_masked,
            )
        return out

    def shortage(
        self, task: str, fields: Sequence[str], batch_size: int, whole_groups: bool
    ) -> str:
        """Why a request for ``batch_size`` rows cannot be served (a scan: error path only)."""
        t = self.tasks.get(task) or TaskState()
        avail = [r for r in self.rows.values(COMMITTED) if self.available(r, task)]
        missing: dict[str, int] = {}
        ready = 0
        for r in avail:
            lacking = [f for f in fields if not r.written & self.bits[f]]
            for f in lacking:
                missing[f] = missing.get(f, 0) + 1
            ready += not lacking
        parts = [f"{ready} of {batch_size} rows ready"]
        for f in fields:
            if missing.get(f):
                parts.append(f"field {f!r} not written for {missing[f]} available rows")
        pending = len(self.rows) - self.committed
        if pending:
            parts.append(f"{pending} rows still being put")
        if t.leased:
            parts.append(f"{len(t.leased)} rows leased to {task!r} and not yet acked")
        if t.n_acked:
            parts.append(f"{t.n_acked} rows already consumed by {task!r}")
        if whole_groups:
            gv = self.group_views.get((task, self.mask_of(fields)))
            groups = len(gv.ready) if gv is not None else 0
            rows = gv.ready_rows if gv is not None else 0
            parts.append(f"whole_groups: {groups} complete groups ready ({rows} rows)")
        return "; ".join(parts)
