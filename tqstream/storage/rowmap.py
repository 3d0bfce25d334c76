"""Row-id maps of a storage unit's index that hold a put's run of rows in O(1) memory.

A put of n consecutive rows would cost n entries in each per-row dict of the column store (the
rows, each field, the chunk's positions): ~0.3 s of a unit's loop and ~100 bytes per row and dict
for 10⁶ rows. :class:`RowMap` keeps such a run as one *span* (first, stop, value) and rows set
one by one in a dict that takes precedence over the spans; a span notes the rows removed from it,
and goes, with that note, once it serves none of its rows. :class:`RunPositions` is a chunk's
row -> position map when its rows are a run.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")

SPAN_MIN = 64
"""Runs of at most this many rows go into the dict (a span's lookup costs more than its entries
save)."""


_MISS: Any = object()


class _Span:
    __slots__ = ("gone", "live", "start", "stop", "value")

    def __init__(self, start: int, stop: int, value: Any) -> None:
        self.start, self.stop, self.value = start, stop, value
        self.gone: set[int] = set()  # rows of the span removed since (none held in the dict)
        self.live = stop - start  # rows the span serves: neither gone nor held in the dict


class RowMap(Generic[V]):
    """row id -> value, for the rows held; a run set at once (:meth:`set_run`) costs O(1).

    A row is found in the dict first (rows set one by one, including rows of a span set again),
    then in the span over it unless removed from it. A span goes once it serves no row; its
    removed rows go with it (a set of its own), the rows the dict holds stay."""

    __slots__ = ("_dict", "_live", "_spans", "_starts", "_top")

    def __init__(self) -> None:
        self._dict: dict[int, Any] = {}
        self._spans: list[_Span] = []  # sorted by start, disjoint
        self._starts: list[int] = []
        self._live = 0  # rows served by spans
        self._top = 0  # every row ever set is below this

    def __len__(self) -> int:
        return len(self._dict) + self._live

    def __bool__(self) -> bool:
        return bool(self._dict) or self._live > 0

    def _span(self, row: int) -> _Span | None:
        i = bisect_right(self._starts, row) - 1
        if i >= 0:
            s = self._spans[i]
            if row < s.stop:
                return s
        return None

    def get(self, row: int, default: Any = None) -> V | Any:
        v = self._dict.get(row, _MISS)
        if v is not _MISS:
            return v
        if self._spans:
            s = self._span(row)
            if s is not None and row not in s.gone:
                return s.value
        return default

    def get_many(self, rows: Sequence[int]) -> list[V | None]:
        """``[get(row) for row in rows]``, faster for rows that share spans."""
        d = self._dict
        if not self._spans:
            return [d.get(r) for r in rows]
        s = self._serving(rows)
        if s is not None:
            return [s.value] * len(rows)
        return [self.get(r) for r in rows]

    def ids(self) -> np.ndarray:
        """Every row held, ascending (int64)."""
        parts = [np.fromiter(self._dict, np.int64, len(self._dict))]
        for s in self._spans:
            run = np.arange(s.start, s.stop, dtype=np.int64)
            if s.gone:
                run = run[~np.isin(run, np.fromiter(s.gone, np.int64, len(s.gone)))]
            parts.append(run)
        return np.unique(np.concatenate(parts))  # a span's rows set again are in the dict too

    def __contains__(self, row: object) -> bool:
        return self.get(row, _MISS) is not _MISS  # type: ignore[arg-type]

    def __getitem__(self, row: int) -> V:
        v = self.get(row, _MISS)
        if v is _MISS:
            raise KeyError(row)
        return v  # type: ignore[no-any-return]

    def __setitem__(self, row: int, value: V) -> None:
        d = self._dict
        if row not in d and self._spans:
            s = self._span(row)
            if s is not None:
                if row in s.gone:
                    s.gone.discard(row)  # held in the dict from now on
                else:  # the row leaves its span for the dict
                    d[row] = value
                    self._unserve(s, 1)
                    return
        d[row] = value
        if row >= self._top:
            self._top = row + 1

    def pop(self, row: int, default: Any = None) -> V | Any:
        d = self._dict
        v = d.pop(row, _MISS)
        s = self._span(row) if self._spans else None
        if s is None or row in s.gone:
            return default if v is _MISS else v
        s.gone.add(row)  # the span no longer serves it
        if v is not _MISS:
            return v
        self._unserve(s, 1)
        return s.value

    def __delitem__(self, row: int) -> None:
        if self.pop(row, _MISS) is _MISS:
            raise KeyError(row)

    def disjoint(self, rows: Sequence[int]) -> bool:
        """No row of ``rows`` is in the map."""
        if not rows or (isinstance(rows, range) and rows.start >= self._top):
            return True
        if self._apart(rows) and self._clear(rows):
            return True
        return not any(r in self for r in rows)

    def _apart(self, rows: Sequence[int]) -> bool:
        """No row of ``rows`` is in the dict (``keys().isdisjoint`` walks all of ``rows``: for a
        long run, the dict's keys are walked when they are fewer)."""
        d = self._dict
        if not d:
            return True
        if isinstance(rows, range) and rows.step == 1:
            if rows.start >= self._top:
                return True
            if len(d) < len(rows):
                return not any(rows.start <= k < rows.stop for k in d)
        return d.keys().isdisjoint(rows)

    def set_run(self, rows: Sequence[int], value: V) -> None:
        """Every row of ``rows`` maps to ``value``; a long run of new rows becomes one span."""
        if not rows:
            return
        if not self._clear(rows):  # rows of spans leave them one by one
            for r in rows:
                self[r] = value
            return
        if (
            isinstance(rows, range)
            and rows.step == 1
            and len(rows) > SPAN_MIN
            and self._apart(rows)
        ):
            i = bisect_right(self._starts, rows.start)
            self._spans.insert(i, _Span(rows.start, rows.stop, value))
            self._starts.insert(i, rows.start)
            self._live += len(rows)
        else:
            self._dict.update(dict.fromkeys(rows, value))
        top = rows[-1] + 1 if isinstance(rows, range) else max(rows) + 1
        if top > self._top:
            self._top = top

    def pop_many(self, rows: Sequence[int]) -> list[V | None]:
        """``[pop(row) for row in rows]`` (``rows`` without repeats)."""
        if not self._spans:
            d = self._dict
            return [d.pop(r, None) for r in rows]
        s = self._serving(rows)
        if s is not None:
            s.gone.update(rows)
            self._unserve(s, len(rows))
            return [s.value] * len(rows)
        return [self.pop(r) for r in rows]

    def drop_if(self, rows: Sequence[int], value: V) -> None:
        """Remove those of ``rows`` (without repeats) that map to ``value``."""
        if not self._spans:
            d = self._dict
            for r in rows:
                if d.get(r) is value:
                    del d[r]
            return
        s = self._serving(rows)
        if s is not None:
            if s.value is value:
                s.gone.update(rows)
                self._unserve(s, len(rows))
            return
        for r in rows:
            if self.get(r) is value:
                self.pop(r)

    def remove_span(self, start: int, value: V) -> list[int] | None:
        """Forget the span of ``value`` that starts at ``start`` (its chunk is dropped whole):
        its rows leave the map at once, except those the dict holds, which are returned (the
        caller settles them one by one). None if there is no such span."""
        i = bisect_right(self._starts, start) - 1
        if i < 0 or self._starts[i] != start or self._spans[i].value is not value:
            return None
        s = self._spans[i]
        self._remove(i, s)
        d = self._dict
        if len(d) < s.stop - s.start:
            return [r for r in d if s.start <= r < s.stop]
        return [r for r in range(s.start, s.stop) if r in d]

    def _serving(self, rows: Sequence[int]) -> _Span | None:
        """The span that serves every row of ``rows``, if one does."""
        if not rows:
            return None
        lo, hi = _bounds(rows)
        s = self._span(lo)
        if (
            s is None
            or hi >= s.stop
            or not self._apart(rows)
            or (s.gone and not s.gone.isdisjoint(rows))
        ):
            return None
        return s

    def _clear(self, rows: Sequence[int]) -> bool:
        """No span overlaps the rows from the least of ``rows`` to the greatest."""
        if not self._spans:
            return True
        lo, hi = _bounds(rows)
        i = bisect_right(self._starts, lo) - 1
        if i >= 0 and self._spans[i].stop > lo:
            return False
        return i + 1 >= len(self._starts) or self._starts[i + 1] > hi

    def _unserve(self, s: _Span, n: int) -> None:
        """``n`` rows of ``s`` are no longer served by it; a span serving none goes."""
        s.live -= n
        self._live -= n
        if not s.live:
            self._remove(bisect_right(self._starts, s.start) - 1, s)

    def _remove(self, i: int, s: _Span) -> None:
        del self._spans[i], self._starts[i]
        self._live -= s.live

    def __iter__(self) -> Iterator[int]:
        yield from list(self._dict)
        for s in list(self._spans):
            for r in range(s.start, s.stop):
                if r not in s.gone and r not in self._dict:
                    yield r


def _bounds(rows: Sequence[int]) -> tuple[int, int]:
    if isinstance(rows, range):
        return (rows.start, rows[-1]) if rows.step > 0 else (rows[-1], rows.start)
    return min(rows), max(rows)


class RunPositions:
    """A chunk's row -> position for rows ``first .. first + n - 1`` (position = row - first),
    less those removed; the ``dict`` it stands for costs ~100 bytes a row."""

    __slots__ = ("first", "gone", "n")

    def __init__(self, first: int, n: int) -> None:
        self.first, self.n = first, n
        self.gone: set[int] = set()

    def __contains__(self, row: object) -> bool:
        return 0 <= row - self.first < self.n and row not in self.gone  # type: ignore[operator]

    def __getitem__(self, row: int) -> int:
        if row not in self:
            raise KeyError(row)
        return row - self.first

    def __delitem__(self, row: int) -> None:
        if row not in self:
            raise KeyError(row)
        self.gone.add(row)

    def __len__(self) -> int:
        return self.n - len(self.gone)

    def discard_many(self, rows: Sequence[int]) -> None:
        """Remove ``rows`` (held here, no repeats)."""
        self.gone.update(rows)

    def clear(self) -> None:
        self.n = 0
        self.gone.clear()

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[int]:
        gone = self.gone
        return (r for r in range(self.first, self.first + self.n) if r not in gone)


def positions(rows: Sequence[int]) -> dict[int, int] | RunPositions:
    """row -> its position in ``rows``: a :class:`RunPositions` for a long run."""
    if isinstance(rows, range) and rows.step == 1 and len(rows) > SPAN_MIN:
        return RunPositions(rows.start, len(rows))
    return dict(zip(rows, range(len(rows)), strict=True))
