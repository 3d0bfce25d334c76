"""Per-task consumption of one partition: each task's leased and acked rows (``TaskState``), the
views of the rows ready and available to a task (see ``views.py``), and the selection of a
batch from them.

:class:`Consumption` owns these tables: a row becomes leased (:meth:`~Consumption.lease`), acked
(:meth:`~Consumption.ack`) or available again (:meth:`~Consumption.release`,
:meth:`~Consumption.reset`) here only, and the partition tells it of rows committed, written,
removed and trimmed, so every view stays exact and selection never rescans. It reads the
partition's rows, fields and groups; it changes none of them.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from typing import Protocol

import numpy as np

from tqstream.controller.rows import COMMITTED, Row, Rows
from tqstream.controller.views import GroupKey, GroupView, ReadyView
from tqstream.types import TaskStats


class Sized(Protocol):
    size: int


class Matrix(Protocol):
    """What consumption reads of its partition (``Partition``): the rows, fields and groups."""

    rows: Rows
    committed: int
    bits: dict[str, int]

    @property
    def groups(self) -> Mapping[str, Sized]: ...
    def mask_of(self, fields: Sequence[str]) -> int: ...
    def group_of(self, rid: int) -> tuple[GroupKey, int]: ...
    def group_members(self, key: GroupKey) -> list[int]: ...
    def ready_seq(self, rid: int, mask: int) -> int: ...
    def group_seq(self, rid: int, mask: int) -> int: ...


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


class Consumption(Mapping[str, TaskState]):
    """The tasks of a partition (a read-only mapping of name to :class:`TaskState`), their views,
    and every change of who consumed what."""

    def __init__(self, p: Matrix) -> None:
        self.p = p
        self._tasks: dict[str, TaskState] = {}
        self.views: dict[tuple[str, int], ReadyView] = {}
        self.group_views: dict[tuple[str, int], GroupView] = {}
        self.stale_seen: list[int] = []  # filled by select() under a staleness window

    def __getitem__(self, name: str) -> TaskState:
        return self._tasks[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks or self.views or self.group_views)

    def available(self, r: Row | int, task: str) -> bool:
        """Whether ``task`` may still be served row ``r`` (neither leased nor acked by it)."""
        t = self._tasks.get(task)
        if t is None:
            return True
        rid = r if isinstance(r, int) else r.id
        return rid not in t.leased and not t.is_acked(rid)

    # --- the partition's rows changed ---
    def rows_committed(self, ids: Sequence[int], seqs: range, mask: int) -> None:
        """Pending rows became visible with the fields of ``mask``: new to every task and view,
        each view they complete takes them in one update."""
        for (_, vmask), v in self.views.items():
            if mask & vmask == vmask:
                v.add_new(ids, seqs)
        for (_, vmask), gv in self.group_views.items():
            if mask & vmask == vmask:
                for rid, seq in zip(ids, seqs, strict=True):
                    key, size = self.p.group_of(rid)
                    gv.add(key, size, seq)

    def row_written(self, rid: int, old: int, new: int, seq: int) -> None:
        """Committed row ``rid`` went from fields ``old`` to ``new`` at ``seq``."""
        for (task, vmask), v in self.views.items():
            if (old & vmask) != vmask and (new & vmask) == vmask and self.available(rid, task):
                v.add(rid, seq)
        for (task, vmask), gv in self.group_views.items():
            if (old & vmask) != vmask and (new & vmask) == vmask and self.available(rid, task):
                key, size = self.p.group_of(rid)
                gv.add(key, size, seq)

    def rows_leaving(self, committed: Sequence[int] | np.ndarray) -> None:
        """Committed rows are about to be removed: the group views they count in let them go
        (while who has them is still known)."""
        if not self.group_views:
            return
        rows = self.p.rows
        written, base = rows.written, rows.base
        ids = committed.tolist() if isinstance(committed, np.ndarray) else committed
        for (task, vmask), gv in self.group_views.items():
            for rid in ids:
                if (written[rid - base] & vmask) == vmask and self.available(rid, task):
                    gkey, size = self.p.group_of(rid)
                    gv.remove(gkey, size)

    def rows_removed(self, ids: Sequence[int], bulk: np.ndarray | None = None) -> None:
        """Rows ``ids`` are gone (``bulk``: the same as an array, for many rows): no view or task
        holds them."""
        for v in self.views.values():
            v.forget(ids if bulk is None else bulk)
        gone: set[int] | None = None  # many rows: taken out of each task's leases by one set
        for t in self._tasks.values():
            if t.leased and bulk is None:
                for rid in ids:
                    t.leased.pop(rid, None)
            elif t.leased:
                gone = set(ids) if gone is None else gone
                for rid in t.leased.keys() & gone:
                    del t.leased[rid]
            if t.n_acked:
                if bulk is not None:
                    t.unmark_all(bulk)
                else:
                    for rid in ids:
                        t.unmark(rid)

    def group_gone(self, key: GroupKey) -> None:
        """Group ``key`` (a name, or the id of a row of no group) has no member left."""
        for gv in self.group_views.values():
            gv.forget(key)

    def trim(self, base: int) -> None:
        """The partition's rows now start at ``base``."""
        for t in self._tasks.values():
            t.trim(min(base - t.base, len(t.marks))) if base > t.base else None
            t.base = max(t.base, base)
        for v in self.views.values():
            if base > v.base:
                v.trim(base - v.base)

    # --- consumption ---
    def task(self, name: str) -> TaskState:
        t = self._tasks.get(name)
        if t is None:
            t = self._tasks[name] = TaskState(self.p.rows.base)
        return t

    def lease(self, task: str, rows: Sequence[int], lease_id: int) -> None:
        t = self.task(task)
        for (vtask, _), v in self.views.items():
            if vtask == task:
                v.remove(rows)
        written, base = self.p.rows.written, self.p.rows.base
        for (vtask, vmask), gv in self.group_views.items():
            if vtask == task:
                for rid in rows:
                    if (written[rid - base] & vmask) == vmask:
                        key, size = self.p.group_of(rid)
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
        t = self._tasks.get(task)
        if t is None:
            return 0
        n = len(t.leased) + t.n_acked
        t.clear()
        t.base = self.p.rows.base
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
        written = self.p.rows.written[rid - self.p.rows.base]
        for (vtask, vmask), v in self.views.items():
            if vtask == task and (written & vmask) == vmask:
                v.add(rid, self.p.ready_seq(rid, vmask))
        for (vtask, vmask), gv in self.group_views.items():
            if vtask == task and (written & vmask) == vmask:
                key, size = self.p.group_of(rid)
                completes = gv.count.get(key, 0) + 1 == size and key not in gv.seq_of
                seq = (
                    self.p.group_seq(rid, vmask)
                    if completes
                    else self.p.rows.seq[rid - self.p.rows.base]
                )
                gv.add(key, size, seq)

    # --- views and selection ---
    def _ready_for(self, task: str, mask: int) -> tuple[np.ndarray, np.ndarray]:
        """One-time scan used to build a new view: the committed rows ready for ``mask`` and
        available to ``task``, and when each became ready for it, ordered by that."""
        rows = self.p.rows
        if isinstance(rows.written, array):
            state = np.frombuffer(rows.state, np.uint8)
            written = np.frombuffer(rows.written, np.uint64)
            ok = (state == COMMITTED) & ((written & np.uint64(mask)) == np.uint64(mask))
            t = self._tasks.get(task)
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
                    seqs[j] = self.p.ready_seq(int(ids[j]), mask)
            if len(seqs) > 1 and not (seqs[1:] >= seqs[:-1]).all():
                order = np.argsort(seqs, kind="stable")
                ids, seqs = ids[order], seqs[order]
            return ids, seqs
        pairs = sorted(
            (self.p.ready_seq(rid, mask), rid)
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
            v = self.views[(task, mask)] = ReadyView(task, mask, self.p.rows.base)
            v.add_new(*self._ready_for(task, mask))  # one bulk update
        return v

    def group_view(self, task: str, mask: int) -> GroupView:
        gv = self.group_views.get((task, mask))
        if gv is None:
            self.task(task)
            gv = self.group_views[(task, mask)] = GroupView(task, mask)
            ids, seqs = self._ready_for(task, mask)
            gv.add_new(
                (*self.p.group_of(rid), seq)
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
            members = self.p.group_members(key)
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
        sizes = [1 if isinstance(k, int) else self.p.groups[k].size for k in keys]
        full = (1 << (batch_size + 1)) - 1
        reach = [1] * (len(keys) + 1)  # bit n of reach[i]: groups i.. can make exactly n rows
        for i in range(len(keys) - 1, -1, -1):
            reach[i] = (reach[i + 1] | reach[i + 1] << sizes[i]) & full
        if not reach[0] >> batch_size & 1:
            return None
        picked, need = [], batch_size
        for i, key in enumerate(keys):
            if sizes[i] <= need and reach[i + 1] >> (need - sizes[i]) & 1:
                picked.extend(self.p.group_members(key))
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
            members = self.p.group_members(key)
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
        rows = self.p.rows
        return any(
            (rows.written[rid - rows.base] & mask) != mask and not t.is_acked(rid)
            for rid in rows.ids(COMMITTED)
        )

    # --- reporting ---
    def task_stats(self) -> dict[str, TaskStats]:
        out = {}
        for name, t in self._tasks.items():
            out[name] = TaskStats(
                available=self.p.committed - len(t.leased) - t.n_acked,
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
        t = self._tasks.get(task) or TaskState()
        avail = [r for r in self.p.rows.values(COMMITTED) if self.available(r, task)]
        missing: dict[str, int] = {}
        ready = 0
        for r in avail:
            lacking = [f for f in fields if not r.written & self.p.bits[f]]
            for f in lacking:
                missing[f] = missing.get(f, 0) + 1
            ready += not lacking
        parts = [f"{ready} of {batch_size} rows ready"]
        for f in fields:
            if missing.get(f):
                parts.append(f"field {f!r} not written for {missing[f]} available rows")
        pending = len(self.p.rows) - self.p.committed
        if pending:
            parts.append(f"{pending} rows still being put")
        if t.leased:
            parts.append(f"{len(t.leased)} rows leased to {task!r} and not yet acked")
        if t.n_acked:
            parts.append(f"{t.n_acked} rows already consumed by {task!r}")
        if whole_groups:
            gv = self.group_views.get((task, self.p.mask_of(fields)))
            groups = len(gv.ready) if gv is not None else 0
            rows = gv.ready_rows if gv is not None else 0
            parts.append(f"whole_groups: {groups} complete groups ready ({rows} rows)")
        return "; ".join(parts)
