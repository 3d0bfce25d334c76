"""The shapes of a partition's tensor fields, as TransferQueue's metadata reports them.

Only puts made through the TransferQueue compatibility layer send a record (``RowShapes``); a
field no such put wrote has none, and its metadata says what its schema says. A field's record
follows TransferQueue's rules: its first write sets it (regular rows of one shape, or nested rows
with a shape each); rows of another shape, or nested rows, turn it nested, each row's shape then
kept; removals that leave rows of one shape turn it regular again, and the last removal forgets it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from tqstream.types import RowShapes

Shape = tuple[int, ...]


class FieldShapes:
    """One field's record: the rows it covers, and their one shape or each row's."""

    __slots__ = ("ids", "per_row", "shape")

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.shape: Shape | None = None  # every row's, while the field is regular
        self.per_row: dict[int, Shape] | None = None  # each row's, once it is nested

    def write(self, ids: Sequence[int], given: RowShapes) -> None:
        if given.nested:
            shapes = list(given.rows or ())
            if len(shapes) != len(ids):  # checked at the prepare: never refused here
                return
            self._nest()
            assert self.per_row is not None
            self.per_row.update(zip(ids, shapes, strict=True))
        elif self.per_row is not None or (self.ids and self.shape != given.shape):
            self._nest()  # rows of another shape: each row's kept
            assert self.per_row is not None
            self.per_row.update((rid, given.shape or ()) for rid in ids)
        else:
            self.shape = given.shape
        self.ids.update(ids)

    def _nest(self) -> None:
        if self.per_row is None:
            self.per_row = dict.fromkeys(self.ids, self.shape or ())
            self.shape = None

    def forget(self, ids: Iterable[int]) -> bool:
        """Drop removed rows; True when none is left (the record goes)."""
        for rid in ids:
            self.ids.discard(rid)
            if self.per_row is not None:
                self.per_row.pop(rid, None)
        if not self.ids:
            return True
        if self.per_row is not None and len(set(self.per_row.values())) == 1:
            self.shape, self.per_row = next(iter(self.per_row.values())), None
        return False

    def of(self, ids: Sequence[int]) -> RowShapes:
        if self.per_row is None:
            return RowShapes(False, self.shape)
        known = self.per_row
        return RowShapes(True, None, [known.get(rid, ()) for rid in ids])


class ShapesEntry(msgspec.Struct, frozen=True, array_like=True):
    """One field's record in a checkpoint: its rows, their one shape or, nested, each row's."""

    ids: list[int]
    shape: tuple[int, ...] | None = None
    rows: list[tuple[int, ...]] | None = None


class Shapes:
    """A partition's records, by field."""

    __slots__ = ("fields",)

    def __init__(self) -> None:
        self.fields: dict[str, FieldShapes] = {}

    def __bool__(self) -> bool:
        return bool(self.fields)

    def write(
        self, ids: Sequence[int], given: dict[str, RowShapes], held: Sequence[bool] | None = None
    ) -> None:
        """Rows ``ids`` were written with ``given``; ``held``: per row, whether it is still there
        (a put_fields whose rows were cleared meanwhile), None: all are."""
        for name, shapes in given.items():
            if held is not None:
                ids = [rid for rid, h in zip(ids, held, strict=True) if h]
                if shapes.rows is not None:
                    kept = [s for s, h in zip(shapes.rows, held, strict=True) if h]
                    shapes = RowShapes(True, None, kept)
            if ids:
                self.fields.setdefault(name, FieldShapes()).write(ids, shapes)

    def forget(self, ids: Sequence[int]) -> None:
        gone = [name for name, f in self.fields.items() if f.forget(ids)]
        for name in gone:
            del self.fields[name]

    def of(self, fields: Iterable[str], ids: Sequence[int]) -> dict[str, RowShapes]:
        return {f: self.fields[f].of(ids) for f in fields if f in self.fields}

    def save(self, held: set[int]) -> dict[str, ShapesEntry]:
        """The records of rows ``held`` (a checkpoint's committed rows)."""
        out = {}
        for name, f in self.fields.items():
            ids = sorted(f.ids & held)
            if not ids:
                continue
            if f.per_row is None:
                out[name] = ShapesEntry(ids, f.shape)
            else:
                out[name] = ShapesEntry(ids, None, [f.per_row[rid] for rid in ids])
        return out

    @classmethod
    def load(cls, entries: dict[str, ShapesEntry]) -> Shapes:
        out = cls()
        for name, e in entries.items():
            f = out.fields[name] = FieldShapes()
            f.ids = set(e.ids)
            if e.rows is None:
                f.shape = e.shape
            else:
                f.per_row = dict(zip(e.ids, e.rows, strict=True))
        return out


def shapes_problem(given: dict[str, RowShapes] | None, fields: Iterable[str], n: int) -> str | None:
    """Why a put's record does not fit its ``n`` rows and ``fields``; None if it does."""
    if not given:
        return None
    names = set(fields)
    for name, s in given.items():
        if name not in names:
            return f"shapes name field {name!r}, which the put does not write"
        if s.nested and (s.rows is None or len(s.rows) != n):
            got = "none" if s.rows is None else len(s.rows)
            return f"the nested shapes of field {name!r} list {got} rows, the put has {n}"
        if not s.nested and s.shape is None:
            return f"the regular shapes of field {name!r} give no shape"
    return None
