"""One partition's metadata: schemas, the production matrix, groups and per-task consumption.

Pure state, no I/O. Rows are created *pending* by a prepared put (keys and group slots reserved,
invisible to readers) and become visible at commit; ``written`` is the row's bitmask of committed
fields (the production matrix), ``pending`` the bits of an in-flight ``put_fields``.

Per task a committed row is *available* (in no map), *leased* (``TaskState.leased``) or *acked*
(``TaskState.acked``). Every transition goes through :meth:`Partition.lease`, :meth:`ack`,
:meth:`release`, :meth:`commit_rows`, :meth:`commit_fields` and :meth:`remove_rows`, which keep
every view (see ``views.py``) exact, so selection never rescans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqstream.controller.views import GroupKey, GroupView, ReadyView
from tqstream.errors import (
    DuplicateKeyError,
    GroupError,
    SchemaError,
    UnknownFieldError,
    UnknownKeyError,
)
from tqstream.types import FieldSchema, TaskStats


class Row:
    __slots__ = (
        "committed",
        "dispatch_version",
        "group",
        "id",
        "key",
        "nbytes",
        "pending",
        "ready_seq",
        "replica",
        "tags",
        "unit",
        "version_end",
        "version_start",
        "writes",
        "written",
    )

    def __init__(
        self, row_id: int, group: str | None, unit: int, nbytes: int, version: int | None
    ) -> None:
        self.id = row_id
        self.key: str | None = None  # None: generated from the id (Partition.key_of)
        self.group = group
        self.unit = unit
        self.replica = -1  # the unit holding the second copy; -1: none
        self.nbytes = nbytes
        self.version_start = version
        self.version_end = version
        self.dispatch_version = version
        self.written = 0
        self.pending = 0
        self.committed = False
        self.ready_seq = 0
        # (mask, seq) of each committed write; None while it has at most one, which is then
        # (written, ready_seq) (a put's rows: no list of their own)
        self.writes: list[tuple[int, int]] | None = None
        self.tags: dict[str, Any] | None = None  # the user's small per-row bookkeeping

    def merge_tags(self, tags: dict[str, Any] | None) -> None:
        """Tags are merged key by key: a later write of ``{"status": ...}`` keeps the others."""
        if tags:
            if self.tags is None:
                self.tags = dict(tags)
            else:
                self.tags.update(tags)


class Group:
    __slots__ = ("fields", "members", "size")

    def __init__(self, size: int, fields: frozenset[str]) -> None:
        self.size = size
        self.fields = fields  # what its first put wrote; every member is put with the same
        self.members: list[int] = []


class TaskState:
    __slots__ = ("acked", "consumed", "lag", "leased", "lost", "stale_dropped", "tokens_masked")

    def __init__(self) -> None:
        self.leased: dict[int, int] = {}  # row -> lease id
        self.acked: set[int] = set()
        self.consumed = 0  # rows acked, ever (acked rows leave ``acked`` once freed)
        self.stale_dropped = 0
        self.lost = 0  # rows lost with a storage unit before this task acked them
        self.lag: dict[int, int] = {}  # version lag at ack -> rows
        self.tokens_masked = 0  # generated tokens acked outside a token-measure window


class Partition:
    def __init__(self, name: str, key_prefix: str) -> None:
        self.name = name
        self.key_prefix = key_prefix
        self.schemas: dict[str, FieldSchema] = {}
        self.bits: dict[str, int] = {}  # field -> bit in Row.written
        self.written_count: dict[str, int] = {}  # field -> committed rows having it
        # schemas fixed by writes still in flight only: forgotten if all of those roll back
        self.provisional: set[str] = set()
        self.rows: dict[int, Row] = {}
        # keys are generated from row ids (key_of) and not stored, except the users' keys and the
        # generated ones a user key took the name of: those are here, and in Row.key
        self._named: dict[str, int] = {}
        self._taken: set[int] = set()  # rows to come whose generated name a user key took
        self.groups: dict[str, Group] = {}
        self.tasks: dict[str, TaskState] = {}
        self.views: dict[tuple[str, int], ReadyView] = {}
        self.group_views: dict[tuple[str, int], GroupView] = {}
        self.next_row = 0
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
        for r in rows:
            common &= r.written
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
    ) -> list[Row]:
        """Create ``n`` pending rows of a put of ``fields`` (validated atomically: nothing
        changes on error)."""
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
        first = self.next_row
        rows = [
            Row(rid, None if groups is None else groups[rid - first], -1, 0, version)
            for rid in range(first, first + n)
        ]
        self.next_row += n
        for i, r in enumerate(rows):
            self.rows[r.id] = r
            if keys is not None:
                self.name_row(r, keys[i])
            elif r.id in self._taken:
                self.name_row(r, None)
            if r.group is not None:
                grp = self.groups.get(r.group)
                if grp is None:
                    grp = self.groups[r.group] = Group(group_size or counts[r.group], fields)
                grp.members.append(r.id)
        return rows

    def key_of(self, r: Row) -> str:
        """Row ``r``'s key: the user's, or generated: ``<prefix><row id>`` (with a suffix if a
        user key took that name first)."""
        return r.key if r.key is not None else f"{self.key_prefix}{r.id}"

    def row_of_key(self, key: str) -> Row | None:
        """The row (pending or committed) whose key is ``key``."""
        rid = self._named.get(key)
        if rid is not None:
            return self.rows[rid]
        rid = self._generated_id(key)
        r = None if rid is None else self.rows.get(rid)
        return r if r is not None and r.key is None else None

    def name_row(self, r: Row, key: str | None) -> None:
        """Give row ``r`` (in ``rows``, its key not yet given) the key ``key``, or its generated
        one (None): ``<prefix><row id>``, or with a suffix if a user key took that name."""
        base = f"{self.key_prefix}{r.id}"
        if key is None and r.id in self._taken:
            self._taken.discard(r.id)
            key, n = base, 0
            while (other := self.row_of_key(key)) is not None and other is not r:
                n += 1
                key = f"{base}.{n}"
        if key is None or key == base:
            return  # generated: not stored
        r.key = key
        self._named[key] = r.id
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

    def commit_rows(self, rows: Sequence[Row], mask: int) -> None:
        """Make pending rows visible with the fields of ``mask`` written. Pending rows are new to
        every task and every view, so each view they complete takes them in one update."""
        first = self.seq + 1
        self.seq += len(rows)
        self.committed += len(rows)
        for seq, r in enumerate(rows, first):
            r.committed = True
            r.written = mask
            r.ready_seq = seq  # its one write: (mask, seq), see Row.writes
        self.count_written(mask, len(rows))
        for (_, vmask), v in self.views.items():
            if mask & vmask == vmask:
                v.add_new({r.id: r.ready_seq for r in rows})
        for (_, vmask), gv in self.group_views.items():
            if mask & vmask == vmask:
                for r in rows:
                    key, size = self._group_of(r)
                    gv.add(key, size, r.ready_seq)

    def commit_fields(self, rows: Iterable[Row], mask: int) -> None:
        added: dict[int, int] = {}  # fields newly written -> rows (counted once per kind)
        for r in rows:
            r.pending &= ~mask
            bits = mask & ~r.written
            added[bits] = added.get(bits, 0) + 1
            self._write(r, mask)
        for bits, n in added.items():
            if bits:
                self.count_written(bits, n)

    def _write(self, r: Row, mask: int) -> None:
        """Fields of ``mask`` written (or, overwritten, written again) for committed row ``r``;
        the caller counts them (``_count``)."""
        old = r.written
        if r.writes is None and old:  # its one write so far gets a record of its own
            r.writes = [(old, r.ready_seq)]
        r.written = new = old | mask
        self.seq += 1
        r.ready_seq = self.seq
        if r.writes is not None:
            r.writes.append((mask, self.seq))
        for (task, vmask), v in self.views.items():
            if (old & vmask) != vmask and (new & vmask) == vmask and self.available(r, task):
                v.add(r.id, r.ready_seq)
        for (task, vmask), gv in self.group_views.items():
            if (old & vmask) != vmask and (new & vmask) == vmask and self.available(r, task):
                key, size = self._group_of(r)
                gv.add(key, size, r.ready_seq)

    def count_written(self, mask: int, n: int) -> None:
        """``n`` more (fewer, when negative) committed rows have the fields of ``mask``."""
        for name, bit in self.bits.items():
            if mask & bit:
                self.written_count[name] = self.written_count.get(name, 0) + n
                if n > 0:
                    self.provisional.discard(name)

    def available(self, r: Row, task: str) -> bool:
        """Whether ``task`` may still be served row ``r`` (neither leased nor acked by it)."""
        t = self.tasks.get(task)
        return t is None or (r.id not in t.leased and r.id not in t.acked)

    @staticmethod
    def _ready_seq(r: Row, mask: int) -> int:
        """When ``r`` became ready for ``mask``: the write of the last of its fields (later writes
        of other fields do not move it)."""
        writes = r.writes
        if writes is None:  # written once (a put's rows)
            return r.ready_seq
        return max(seq for m, seq in writes if m & mask)

    @staticmethod
    def writes_of(r: Row) -> list[tuple[int, int]]:
        """The committed writes of ``r``, (fields mask, seq) each, oldest first."""
        if r.writes is not None:
            return r.writes
        return [(r.written, r.ready_seq)] if r.written else []

    def _group_seq(self, r: Row, mask: int) -> int:
        """When the group of ``r`` (all of its members available) became ready for ``mask``."""
        if r.group is None:
            return self._ready_seq(r, mask)
        return max(self._ready_seq(self.rows[m], mask) for m in self.groups[r.group].members)

    def _group_of(self, r: Row) -> tuple[GroupKey, int]:
        if r.group is None:
            return r.id, 1
        return r.group, self.groups[r.group].size

    def remove_rows(self, row_ids: Iterable[int]) -> list[Row]:
        """Delete rows (clear or abort); returns the rows that existed."""
        removed = [r for rid in row_ids if (r := self.rows.pop(rid, None)) is not None]
        if not removed:
            return removed
        written: dict[int, int] = {}  # fields mask of committed rows -> how many
        for r in removed:
            if r.key is not None:
                del self._named[r.key]
            if r.committed:
                written[r.written] = written.get(r.written, 0) + 1
        for mask, n in written.items():
            self.committed -= n
            self.count_written(mask, -n)
        for (task, vmask), gv in self.group_views.items():
            for r in removed:
                if r.committed and (r.written & vmask) == vmask and self.available(r, task):
                    key, size = self._group_of(r)
                    gv.remove(key, size)
        ids = [r.id for r in removed]
        for v in self.views.values():
            v.forget(ids)
        for t in self.tasks.values():
            if t.leased:
                for rid in ids:
                    t.leased.pop(rid, None)
            t.acked.difference_update(ids)
        for r in removed:
            if r.group is not None:
                g = self.groups[r.group]
                g.members.remove(r.id)
                if not g.members:
                    del self.groups[r.group]
                    for gv in self.group_views.values():
                        gv.forget(r.group)
            else:
                for gv in self.group_views.values():
                    gv.forget(r.id)
        return removed

    # --- consumption ---
    def task(self, name: str) -> TaskState:
        t = self.tasks.get(name)
        if t is None:
            t = self.tasks[name] = TaskState()
        return t

    def lease(self, task: str, rows: Sequence[int], lease_id: int) -> None:
        t = self.task(task)
        for (vtask, _), v in self.views.items():
            if vtask == task:
                v.remove(rows)
        for (vtask, vmask), gv in self.group_views.items():
            if vtask == task:
                for rid in rows:
                    r = self.rows[rid]
                    if (r.written & vmask) == vmask:
                        key, size = self._group_of(r)
                        gv.remove(key, size)
        t.leased.update(dict.fromkeys(rows, lease_id))

    def ack(self, task: str, rows: Iterable[int]) -> int:
        t = self.task(task)
        n = 0
        for rid in rows:
            if t.leased.pop(rid, None) is not None:
                t.acked.add(rid)
                n += 1
        t.consumed += n
        return n

    def reset(self, task: str) -> int:
        """Every row ``task`` leased or acked is available to it again (its views are rebuilt by
        the next request that needs them: one scan). Returns how many rows that was."""
        t = self.tasks.get(task)
        if t is None:
            return 0
        n = len(t.leased) + len(t.acked)
        t.leased.clear()
        t.acked.clear()
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
                self._now_available(self.rows[rid], task)
                n += 1
        return n

    def _now_available(self, r: Row, task: str) -> None:
        for (vtask, vmask), v in self.views.items():
            if vtask == task and (r.written & vmask) == vmask:
                v.add(r.id, self._ready_seq(r, vmask))
        for (vtask, vmask), gv in self.group_views.items():
            if vtask == task and (r.written & vmask) == vmask:
                key, size = self._group_of(r)
                completes = gv.count.get(key, 0) + 1 == size and key not in gv.seq_of
                gv.add(key, size, self._group_seq(r, vmask) if completes else r.ready_seq)

    # --- selection ---
    def _ready_for(self, task: str, mask: int) -> dict[int, int]:
        """One-time scan used to build a new view: row -> when it became ready for ``mask``, of
        the committed rows ready for it and available to ``task``."""
        ready_seq, available = self._ready_seq, self.available
        return {
            r.id: ready_seq(r, mask)
            for r in self.rows.values()
            if r.committed and (r.written & mask) == mask and available(r, task)
        }

    def view(self, task: str, mask: int) -> ReadyView:
        v = self.views.get((task, mask))
        if v is None:
            self.task(task)
            v = self.views[(task, mask)] = ReadyView(task, mask)
            v.add_new(self._ready_for(task, mask))  # one bulk update: sorted once
        return v

    def group_view(self, task: str, mask: int) -> GroupView:
        gv = self.group_views.get((task, mask))
        if gv is None:
            self.task(task)
            gv = self.group_views[(task, mask)] = GroupView(task, mask)
            ready = sorted((seq, rid) for rid, seq in self._ready_for(task, mask).items())
            gv.add_new((*self._group_of(self.rows[rid]), seq) for seq, rid in ready)
        return gv

    def select(
        self,
        task: str,
        mask: int,
        batch_size: int,
        whole_groups: bool,
        fresh: Callable[[Row], bool] | None = None,
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
            for rid in v.ready.values():
                if fresh(self.rows[rid]):
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
            members = [key] if isinstance(key, int) else self.groups[key].members
            if fresh is not None and not all(fresh(self.rows[m]) for m in members):
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
                picked.extend([key] if isinstance(key, int) else self.groups[key].members)
                need -= sizes[i]
                if need == 0:
                    break
        return picked

    def select_rest(
        self, task: str, mask: int, batch_size: int, whole_groups: bool,
        fresh: Callable[[Row], bool] | None = None,
    ) -> list[int]:  # fmt: skip
        """The oldest servable rows, up to ``batch_size`` (possibly none): the last, short batch
        of a closed partition. Whole groups only with ``whole_groups``: an incomplete group of a
        closed partition can never be served."""
        if not whole_groups:
            v = self.view(task, mask)
            return [rid for rid in v.ready.values() if fresh is None or fresh(self.rows[rid])][
                :batch_size
            ]
        picked: list[int] = []
        for key in self.group_view(task, mask).oldest():
            members = [key] if isinstance(key, int) else self.groups[key].members
            if fresh is not None and not all(fresh(self.rows[m]) for m in members):
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
        return any(
            r.committed and (r.written & mask) != mask and r.id not in t.acked
            for r in self.rows.values()
        )

    # --- reporting ---
    def task_stats(self) -> dict[str, TaskStats]:
        out = {}
        for name, t in self.tasks.items():
            out[name] = TaskStats(
                available=self.committed - len(t.leased) - len(t.acked),
                leased=len(t.leased),
                acked=len(t.acked),
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
        avail = [r for r in self.rows.values() if r.committed and self.available(r, task)]
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
        pending = sum(1 for r in self.rows.values() if not r.committed)
        if pending:
            parts.append(f"{pending} rows still being put")
        if t.leased:
            parts.append(f"{len(t.leased)} rows leased to {task!r} and not yet acked")
        if t.acked:
            parts.append(f"{len(t.acked)} rows already consumed by {task!r}")
        if whole_groups:
            gv = self.group_views.get((task, self.mask_of(fields)))
            groups = len(gv.ready) if gv is not None else 0
            rows = gv.ready_rows if gv is not None else 0
            parts.append(f"whole_groups: {groups} complete groups ready ({rows} rows)")
        return "; ".join(parts)
