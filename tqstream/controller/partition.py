"""One partition's metadata: schemas, the production matrix, keys and groups.

Pure state, no I/O. Rows are created *pending* by a prepared put (keys and group slots reserved,
invisible to readers) and become visible at commit; ``written`` is the row's bitmask of committed
fields (the production matrix), ``pending`` the bits of an in-flight ``put_fields``.

The rows themselves are columns (``rows.py``); who consumed them is ``Partition.tasks``
(``consumption.py``), which :meth:`Partition.commit_rows`, :meth:`~Partition.commit_fields`,
:meth:`~Partition.remove_rows` and :meth:`~Partition.trim` tell of every change of the rows, so
its views stay exact and selection never rescans.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from tqstream.controller.consumption import Consumption
from tqstream.controller.rows import COMMITTED, NO_VERSION, SMALL, Row, Rows
from tqstream.controller.shapes import Shapes
from tqstream.controller.views import GroupKey
from tqstream.errors import (
    DuplicateKeyError,
    GroupError,
    SchemaError,
    UnknownFieldError,
    UnknownKeyError,
)
from tqstream.types import FieldSchema

TRIM_MIN = 4096
"""The columns drop their leading holes once there are this many and they are the larger half."""


class Group:
    __slots__ = ("fields", "members", "number", "size")

    def __init__(self, size: int, fields: frozenset[str], number: int = -1) -> None:
        self.size = size
        self.number = number  # its number in the rows' group column
        self.fields = fields  # what its first put wrote; every member is put with the same
        self.members: list[int] = []


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
        self.tasks = Consumption(self)  # who consumed what, and the views of what is ready
        self.seq = 0
        self.committed = 0
        # set by the controller: the id counter's value at creation, or the load's that restored
        # it (the incarnation id; the rows' generation at the storage units)
        self.born = 0
        self.registered: list[str] = []  # a row all of these tasks acked is freed
        self.ttl: float | None = None
        self.admission: str | None = None  # a capacity admission gets stale evictions back
        self.produced = self.rejected = self.stale_dropped = self.expired = self.freed = 0
        self.lost = 0  # rows lost with a storage unit that held their only copy
        self.replicas: int | None = None  # copies of each row; None: the controller's default
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
        assert not self.tasks
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
        self.tasks.rows_committed(ids, range(first, first + n), mask)

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
        self.tasks.row_written(rid, old, new, seq)

    def count_written(self, mask: int, n: int) -> None:
        """``n`` more (fewer, when negative) committed rows have the fields of ``mask``."""
        for name, bit in self.bits.items():
            if mask & bit:
                self.written_count[name] = self.written_count.get(name, 0) + n
                if n > 0:
                    self.provisional.discard(name)

    def ready_seq(self, rid: int, mask: int) -> int:
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

    def group_seq(self, rid: int, mask: int) -> int:
        """When the group of row ``rid`` (all of its members available) became ready for
        ``mask``."""
        g = self.rows.group[rid - self.rows.base]
        if g < 0:
            return self.ready_seq(rid, mask)
        members = self.groups[self.rows.group_names[g]].members
        return max(self.ready_seq(m, mask) for m in members)

    def group_of(self, rid: int) -> tuple[GroupKey, int]:
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
        self.tasks.rows_leaving(committed + base)
        self.tasks.rows_removed(ids, idx + base)
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
                    self.tasks.group_gone(name)
        if self.tasks.group_views:
            groups = np.frombuffer(rows.group, np.int32)[idx]
            for rid in (idx[groups < 0] + base).tolist():
                self.tasks.group_gone(rid)
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
        committed = [rid for rid in ids if state[rid - base] == COMMITTED]
        for rid in committed:
            w = written[rid - base]
            counts[w] = counts.get(w, 0) + 1
        self.tasks.rows_leaving(committed)
        if rows.named:
            for rid in ids:
                key = rows.named.get(rid)
                if key is not None:
                    del self._named[key]
        for mask, n in counts.items():
            self.committed -= n
            self.count_written(mask, -n)
        self.tasks.rows_removed(ids)
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
                    self.tasks.group_gone(name)
            elif self.tasks.group_views:
                self.tasks.group_gone(rid)
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
        self.tasks.trim(rows.base)
