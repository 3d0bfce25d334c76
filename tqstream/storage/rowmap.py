"""Row-id maps of a storage unit's index that hold a put's run of rows in O(1) memory.

A put of n consecutive rows would cost n entries in each per-row dict of the column store (the
rows, each field, the chunk's positions): ~0.3 s of a unit's loop and ~100 bytes per row and dict
for 10⁶ rows. :class:`RowMap` keeps such a run as one *span* (first, stop, value) and rows set or
removed one by one in a dict that takes precedence over the spans (a removed row of a span is a
tombstone there); a span goes, with its tombstones, once none of its rows is served by it any
more. :class:`RunPositions` is a chunk's row -> position map when its rows are a run.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

V = TypeVar("V")

SPAN_MIN = 64
"""Runs of at most this many rows go into the dict (a span's lookup costs more than its entries
save)."""


class _Tomb:
    __slots__ = ()


_GONE: Any = _Tomb()
_MISS: Any = object()


class _Span:
    __slots__ = ("live", "start", "stop", "value")

    def __init__(self, start: int, stop: int, value: Any) -> None:
        self.start, self.stop, self.value = start, stop, value
        self.live = stop - start  # rows of the span with no dict entry (served by the span)


class RowMap(Generic[V]):
    """row id -> value, for the rows held; a run set at once (:meth:`set_run`) costs O(1)."""

    __slots__ = ("_dict", "_gone", "_live", "_spans", "_starts", "_top")

    def __init__(self) -> None:
        self._dict: dict[int, Any] = {}  # row -> value, or _GONE over a span's row
        self._spans: list[_Span] = []  # sorted by start, disjoint
        self._starts: list[int] = []
        self._gone = 0  # tombstones in _dict
        self._live = 0  # rows served by spans
        self._top = 0  # every row ever set is below this

    def __len__(self) -> int:
        return len(self._dict) - self._gone + self._live

    def __bool__(self) -> bool:
        return len(self) > 0

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
            return default if v is _GONE else v
        if self._spans:
            s = self._span(row)
            if s is not None:
                return s.value
        return default

    def get_many(self, rows: Sequence[int]) -> list[V | None]:
        """``[get(row) for row in rows]``, faster for rows that share spans."""
        d, out = self._dict, []
        if not self._spans:
            return [d.get(r) for r in rows]
        s: _Span | None = None
        for r in rows:
            v = d.get(r, _MISS)
            if v is _MISS:
                if s is None or not s.start <= r < s.stop:
                    s = self._span(r)
                v = None if s is None else s.value
            elif v is _GONE:
                v = None
            out.append(v)
        return out

    def __contains__(self, row: object) -> bool:
        return self.get(row, _MISS) is not _MISS  # type: ignore[arg-type]

    def __getitem__(self, row: int) -> V:
        v = self.get(row, _MISS)
        if v is _MISS:
            raise KeyError(row)
        return v  # type: ignore[no-any-return]

    def __setitem__(self, row: int, value: V) -> None:
        old = self._dict.get(row, _MISS)
        if old is _MISS and self._spans:
            s = self._span(row)
            if s is not None:  # the row leaves its span for the dict
                self._dict[row] = value
                self._unserve(s)
                return
        elif old is _GONE:
            self._gone -= 1
        self._dict[row] = value
        if row >= self._top:
            self._top = row + 1

    def pop(self, row: int, default: Any = None) -> V | Any:
        d = self._dict
        v = d.get(row, _MISS)
        s = self._span(row) if self._spans and v is not _GONE else None
        if v is _MISS:
            if s is None:
                return default
            d[row] = _GONE
            self._gone += 1
            value = s.value
            self._unserve(s)
            return value
        if v is _GONE:
            return default
        if s is not None:
            d[row] = _GONE
            self._gone += 1
        else:
            del d[row]
        return v

    def __delitem__(self, row: int) -> None:
        if self.pop(row, _MISS) is _MISS:
            raise KeyError(row)

    def disjoint(self, rows: Sequence[int]) -> bool:
        """No row of ``rows`` is in the map."""
        if isinstance(rows, range) and (rows.start >= self._top or not rows):
            return True
        return not any(r in self for r in rows)

    def set_run(self, rows: Sequence[int], value: V) -> None:
        """Every row of ``rows`` maps to ``value``; a long run of new rows becomes one span."""
        if (
            isinstance(rows, range)
            and rows.step == 1
            and len(rows) > SPAN_MIN
            and self.disjoint(rows)
            and self._room(rows)
        ):
            i = bisect_right(self._starts, rows.start)
            self._spans.insert(i, _Span(rows.start, rows.stop, value))
            self._starts.insert(i, rows.start)
            self._live += len(rows)
            self._top = max(self._top, rows.stop)
            return
        for r in rows:
            self[r] = value

    def _room(self, rows: range) -> bool:
        """No span overlaps ``rows`` (tombstones of a span count as its rows)."""
        i = bisect_right(self._starts, rows.start) - 1
        if i >= 0 and self._spans[i].stop > rows.start:
            return False
        return i + 1 >= len(self._starts) or self._starts[i + 1] >= rows.stop

    def remove_span(self, start: int, value: V) -> list[int] | None:
        """Forget the span of ``value`` that starts at ``start`` (its chunk is dropped whole):
        its rows leave the map at once, except those the dict holds apart, which are returned
        (the caller settles them one by one). None if there is no such span."""
        i = bisect_right(self._starts, start) - 1
        if i < 0 or self._starts[i] != start or self._spans[i].value is not value:
            return None
        s = self._spans.pop(i)
        del self._starts[i]
        self._live -= s.live
        d, apart = self._dict, []
        inside = (
            [r for r in d if s.start <= r < s.stop]
            if len(d) < s.stop - s.start
            else [r for r in range(s.start, s.stop) if r in d]
        )
        for r in inside:
            if d[r] is _GONE:
                del d[r]
                self._gone -= 1
            else:
                apart.append(r)
        return apart

    def _unserve(self, s: _Span) -> None:
        """A row of ``s`` is no longer served by it; an empty span goes with its tombstones."""
        s.live -= 1
        self._live -= 1
        if s.live:
            return
        i = bisect_right(self._starts, s.start) - 1
        del self._spans[i], self._starts[i]
        d = self._dict
        for r in range(s.start, s.stop):
            if d.get(r) is _GONE:
                del d[r]
                self._gone -= 1

    def __iter__(self) -> Iterator[int]:
        d = self._dict
        for r, v in list(d.items()):
            if v is not _GONE:
                yield r
        for s in list(self._spans):
            for r in range(s.start, s.stop):
                if r not in d:
                    yield r


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
