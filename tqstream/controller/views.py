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

from collections.abc import Iterable, Iterator

from sortedcontainers import SortedDict

GroupKey = str | int
"""A group name, or the row id of a row that belongs to no group (a group of one)."""


class ReadyView:
    """Rows ready for ``mask`` and available to ``task``, oldest first."""

    __slots__ = ("mask", "ready", "seq_of", "task")

    def __init__(self, task: str, mask: int) -> None:
        self.task = task
        self.mask = mask
        self.seq_of: dict[int, int] = {}  # row -> entry seq, kept while the row lives
        self.ready: SortedDict = SortedDict()  # seq -> row, the currently available ones

    def __len__(self) -> int:
        return len(self.ready)

    def add(self, row: int, seq: int) -> None:
        """Make ``row`` available; ``seq`` orders it unless it entered this view before."""
        self.ready[self.seq_of.setdefault(row, seq)] = row

    def add_new(self, entries: dict[int, int]) -> None:
        """Rows that never entered this view (row -> seq), in one update."""
        self.seq_of.update(entries)
        self.ready.update({seq: row for row, seq in entries.items()})

    def remove(self, rows: Iterable[int]) -> None:
        """The rows are no longer available (leased); they keep their place for a release."""
        seq_of, ready = self.seq_of, self.ready
        seqs = [seq for row in rows if (seq := seq_of.get(row)) is not None]
        oldest = ready.keys()
        if len(seqs) > 1 and seqs == oldest[: len(seqs)]:  # a get's: the oldest, in order
            del oldest[: len(seqs)]  # one slice of the order, not a search per row
            return
        for seq in seqs:
            ready.pop(seq, None)

    def forget(self, rows: Iterable[int]) -> None:
        """The rows are gone."""
        seq_of, ready = self.seq_of, self.ready
        for row in rows:
            seq = seq_of.pop(row, None)
            if seq is not None and seq in ready:  # acked rows left it when leased
                ready.pop(seq)

    def oldest(self, n: int) -> list[int]:
        return [self.ready[s] for s in self.ready.islice(0, n)]


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
