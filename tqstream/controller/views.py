"""Incrementally maintained ready sets.

A *view* answers one kind of request — (task, set of fields, whole groups or not) — in O(batch):
it holds exactly the rows that have every field of the view written and are available to the task,
ordered by the moment each row first became ready for the view ("oldest completed first"). The
partition updates every view on each event (commit, lease, ack, release, expiry, clear), so a
request never rescans the partition; only building a view for a new kind of request scans it once.

A row keeps its entry sequence number for the view while it lives, so a released row goes back to
its old place in the order instead of the end.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from sortedcontainers import SortedDict

from tqstream.controller.rows import SMALL

GroupKey = str | int
"""A group name, or the row id of a row that belongs to no group (a group of one)."""


def _array(values: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(values, range):
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    return np.asarray(values, np.int64)


MEMBER, LOGGED, HEAPED, ENTERED = 1, 2, 4, 8
"""A row's flags in a ready view: available in it now; has an entry in the log not yet passed;
has an entry in the heap; entered the view (its entry seq is set)."""


class ReadyView:
    """Rows ready for ``mask`` and available to ``task``, oldest first.

    Columnar: per row (at ``row id - base``) a flags byte and its entry seq; the order is a log of
    row ids appended as rows enter in seq order (a commit's rows always do), plus a small heap of
    (seq, row) for the rows that come back after the log passed them (released leases) or enter
    out of order. Leases and removals only clear a flag: the entries they leave behind are skipped
    and passed by the next read (so a get's rows, the oldest, cost one step each, once).
    """

    __slots__ = ("base", "count", "flags", "head", "heap", "last", "log", "mask", "seq_of", "task")

    def __init__(self, task: str, mask: int, base: int = 0) -> None:
        self.task = task
        self.mask = mask
        self.base = base  # the row id at index 0 of flags and seq_of
        self.flags = bytearray()
        self.seq_of = array("q")  # row -> entry seq, kept while the row lives
        self.log = array("q")  # row ids in entry order; entries before head were passed
        self.head = 0
        self.last = -1  # the seq of the last logged entry
        self.heap: list[tuple[int, int]] = []  # (seq, row) of rows the log cannot take
        self.count = 0  # rows available in the view

    def __len__(self) -> int:
        return self.count

    def _grow(self, i: int) -> None:
        n = i + 1 - len(self.flags)
        if n > 0:
            self.flags.extend(bytes(n))
            self.seq_of.frombytes(bytes(8 * n))

    def add(self, row: int, seq: int) -> None:
        """Make ``row`` available; ``seq`` orders it unless it entered this view before."""
        i = row - self.base
        self._grow(i)
        f = self.flags[i]
        if f & MEMBER:
            return
        if not f & ENTERED:
            self.seq_of[i] = seq
            f |= ENTERED
            if seq >= self.last:
                self.log.append(row)
                self.last = seq
                f |= LOGGED
        if not f & (LOGGED | HEAPED):
            heapq.heappush(self.heap, (self.seq_of[i], row))
            f |= HEAPED
        self.flags[i] = f | MEMBER
        self.count += 1

    def add_new(self, rows: Sequence[int] | np.ndarray, seqs: Sequence[int] | np.ndarray) -> None:
        """Rows that never entered this view, with their seqs in ascending order."""
        if not len(rows):
            return
        if seqs[0] < self.last:
            for row, seq in zip(rows, seqs, strict=True):
                self.add(int(row), int(seq))
            return
        if len(rows) <= SMALL:
            base = self.base
            self._grow(max(rows) - base)
            flags, seq_of = self.flags, self.seq_of
            for row, seq in zip(rows, seqs, strict=True):
                flags[row - base] = MEMBER | ENTERED | LOGGED
                seq_of[row - base] = seq
            self.log.extend(rows)
            self.last = seqs[-1]
            self.count += len(rows)
            return
        ids = _array(rows)
        idx = ids - self.base
        self._grow(int(idx.max()))
        np.frombuffer(self.flags, np.uint8)[idx] = MEMBER | ENTERED | LOGGED
        np.frombuffer(self.seq_of, np.int64)[idx] = _array(seqs)
        self.log.frombytes(ids.tobytes())
        self.last = int(seqs[-1])
        self.count += len(rows)

    def remove(self, rows: Iterable[int]) -> None:
        """The rows (no repeats) are no longer available (leased); they keep their place for a
        release."""
        if isinstance(rows, Sequence) and len(rows) > SMALL:
            idx = np.asarray(rows, np.int64) - self.base
            idx = idx[(idx >= 0) & (idx < len(self.flags))]
            flags_np = np.frombuffer(self.flags, np.uint8)
            member = idx[(flags_np[idx] & MEMBER) != 0]
            flags_np[member] &= ~np.uint8(MEMBER)
            self.count -= len(member)
            return
        flags, base, n = self.flags, self.base, len(self.flags)
        for row in rows:
            i = row - base
            if 0 <= i < n and flags[i] & MEMBER:
                flags[i] &= ~MEMBER
                self.count -= 1

    def forget(self, rows: Iterable[int] | np.ndarray) -> None:
        """The rows are gone (no repeats)."""
        if isinstance(rows, list) and len(rows) <= SMALL:
            flags, base, n = self.flags, self.base, len(self.flags)
            for row in rows:
                i = row - base
                if 0 <= i < n:
                    if flags[i] & MEMBER:
                        self.count -= 1
                    flags[i] = 0
            return
        idx = np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), np.int64)
        idx = idx - self.base
        idx = idx[(idx >= 0) & (idx < len(self.flags))]
        marks = np.frombuffer(self.flags, np.uint8)
        self.count -= int(np.count_nonzero(marks[idx] & MEMBER))
        marks[idx] = 0

    def trim(self, k: int) -> None:
        """The partition dropped its first ``k`` row ids (no row there)."""
        del self.flags[:k]
        del self.seq_of[:k]
        self.base += k

    def entered(self) -> list[int]:
        """Every row that entered and lives (its place is kept)."""
        idx = np.flatnonzero(np.frombuffer(self.flags, np.uint8) & ENTERED)
        return (idx + self.base).tolist()

    def seq(self, row: int) -> int:
        return self.seq_of[row - self.base]

    def _valid(self, row: int) -> bool:
        i = row - self.base
        return 0 <= i < len(self.flags) and self.flags[i] & MEMBER != 0

    def _clean(self) -> None:
        """Pass the log's and the heap's leading entries of rows not available."""
        log, flags, base, n = self.log, self.flags, self.base, len(self.flags)
        head, end = self.head, len(log)
        stop = min(head + SMALL, end)
        while head < stop:
            i = log[head] - base
            if 0 <= i < n:
                f = flags[i]
                if f & MEMBER:
                    break
                flags[i] = f & ~LOGGED
            head += 1
        else:
            head = self._pass(head)
        if head > 4096 and 2 * head > end:
            del log[:head]
            head = 0
        self.head = head
        heap = self.heap
        while heap:
            i = heap[0][1] - base
            if 0 <= i < n:
                f = flags[i]
                if f & MEMBER:
                    break
                flags[i] = f & ~HEAPED
            heapq.heappop(heap)

    def _pass(self, head: int) -> int:
        """Pass the log's entries of rows not available from ``head`` on, a window at a time."""
        log = np.frombuffer(self.log, np.int64)
        flags = np.frombuffer(self.flags, np.uint8)
        window = 4096
        while head < len(log):
            idx = log[head : head + window] - self.base
            inside = (idx >= 0) & (idx < len(flags))
            member = np.zeros(len(idx), bool)
            member[inside] = (flags[idx[inside]] & MEMBER) != 0
            k = int(member.argmax()) if member.any() else len(idx)
            passed = idx[:k][inside[:k]]
            flags[passed] &= ~np.uint8(LOGGED)
            head += k
            if k < len(idx):
                break
            window *= 2
        return head

    def _oldest_logged(self, n: int) -> list[int]:
        """The oldest ``n`` available rows when the heap is empty: windows of the log."""
        log = np.frombuffer(self.log, np.int64)
        flags = np.frombuffer(self.flags, np.uint8)
        out: list[np.ndarray] = []
        got, at, window = 0, self.head, 2 * n
        while got < n and at < len(log):
            rows = log[at : at + window]
            idx = rows - self.base
            inside = (idx >= 0) & (idx < len(flags))
            member = np.zeros(len(idx), bool)
            member[inside] = (flags[idx[inside]] & MEMBER) != 0
            take = rows[member][: n - got]
            out.append(take)
            got += len(take)
            at += len(rows)
            window *= 2
        return np.concatenate(out).tolist() if out else []  # type: ignore[no-any-return]

    def rows(self) -> Iterator[int]:
        """The available rows, oldest first."""
        self._clean()
        log, flags, seq_of, base, n = self.log, self.flags, self.seq_of, self.base, len(self.flags)
        extra = sorted(self.heap)
        j, m = 0, len(extra)
        for k in range(self.head, len(log)):
            row = log[k]
            i = row - base
            if not (0 <= i < n and flags[i] & MEMBER):
                continue
            s = seq_of[i]
            while j < m and extra[j][0] < s:
                if self._valid(extra[j][1]):
                    yield extra[j][1]
                j += 1
            yield row
        for _, row in extra[j:]:
            if self._valid(row):
                yield row

    def oldest(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if not self.heap:  # the common case: the log alone, its head available
            self._clean()
            if n > SMALL:
                return self._oldest_logged(n)
            log, flags, base, size = self.log, self.flags, self.base, len(self.flags)
            out: list[int] = []
            for k in range(self.head, len(log)):
                row = log[k]
                i = row - base
                if 0 <= i < size and flags[i] & MEMBER:
                    out.append(row)
                    if len(out) == n:
                        break
            return out
        return list(itertools.islice(self.rows(), n))


class GroupView:
    """Complete groups whose members are all ready for ``mask`` and available to ``task``."""

    __slots__ = ("count", "mask", "ready", "ready_rows", "seq_of", "task")

    def __init__(self, task: str, mask: int) -> None:
        self.task = task
        self.mask = mask
        self.count: dict[GroupKey, int] = {}  # members ready and available
        self.seq_of: dict[GroupKey, int] = {}  # group -> entry seq, kept while the group lives
        self.ready: SortedDict = SortedDict()  # seq -> group, groups with count == size
        self.ready_rows = 0  # total members of the groups in ``ready``

    def add(self, group: GroupKey, size: int, seq: int) -> None:
        """One more member is available; ``seq`` orders the group if this completes it first."""
        c = self.count.get(group, 0) + 1
        self.count[group] = c
        if c == size:
            self.ready[self.seq_of.setdefault(group, seq)] = group
            self.ready_rows += size

    def add_new(self, members: Iterable[tuple[GroupKey, int, int]]) -> None:
        """Members (group, size, seq) that never entered this view, oldest first, as ``add``
        would take them one by one, in one update of the order."""
        count, seq_of, done = self.count, self.seq_of, {}
        for group, size, seq in members:
            c = count.get(group, 0) + 1
            count[group] = c
            if c == size:
                done[seq_of.setdefault(group, seq)] = group
                self.ready_rows += size
        self.ready.update(done)

    def remove(self, group: GroupKey, size: int) -> None:
        c = self.count.get(group, 0)
        if c == 0:
            return
        if c == size:
            self.ready.pop(self.seq_of[group], None)
            self.ready_rows -= size
        if c == 1:
            del self.count[group]
        else:
            self.count[group] = c - 1

    def forget(self, group: GroupKey) -> None:
        """The group is gone (all members cleared)."""
        seq = self.seq_of.pop(group, None)
        if seq is not None and self.ready.pop(seq, None) is not None:
            self.ready_rows -= self.count.get(group, 0)
        self.count.pop(group, None)

    def oldest(self) -> Iterator[GroupKey]:
        return iter(self.ready.values())
