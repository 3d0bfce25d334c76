"""Checkpoints on a storage unit: save the rows a controller snapshot names, load saved files.

A ``SaveUnit`` order comes from the controller in the loop step that took its snapshot, on the
connection its drop orders take, so the unit gets it before any drop issued after the snapshot. The
unit captures references to the rows' chunks in the step that handles the order: chunks are never
modified, so the references are a consistent copy at no cost, and they keep the chunks' memory
(frames or shared-memory segments, which a mapped view keeps from reuse) after later drops. The
files are then written on a thread while the unit keeps serving. Rows of a direct put that the
controller committed but whose columns have not reached the store yet (a *landing*, see
``service.py``) are captured as they land, before a drop noted on them meanwhile is applied.

Files hold the rows of one partition. Every chunk holding a field of a row goes to the row's file
(a ``put_fields`` chunk joins the chunks of its rows), and such groups are packed into files of
about ``FILE_BYTES``: a file is what a checkpoint loaded onto another number of storage units
places on one unit.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence

from tqstream.errors import CheckpointError, TQStreamError
from tqstream.protocol.columns import Column
from tqstream.protocol.disk import fsync_dir, in_thread
from tqstream.protocol.messages import LoadUnit, Ok, SavedFile, SaveUnit, UnitSaved
from tqstream.storage.chunkfile import Chunk, read_chunks, write_chunks
from tqstream.storage.columns import ColumnStore

__all__ = ["FILE_BYTES", "UnitCheckpoints"]

FILE_BYTES = 64 << 20
"""A file takes groups of chunks until it holds about this many bytes."""

Held = dict[int, tuple[dict[str, Column], dict[int, int]]]
"""chunk id -> (its columns, row -> position of the rows to save)."""


class _Capture:
    """What one ``SaveUnit`` saves, captured when it arrived (see the module docstring)."""

    __slots__ = ("awaited", "before", "held", "skip")

    def __init__(self, msg: SaveUnit) -> None:
        self.before = msg.before_chunk
        self.skip = set(msg.skip_chunks)
        self.held: dict[str, Held] = {}
        self.awaited: dict[str, set[int]] = {}  # rows not in the store yet: landing

    def keep(self, chunk: int) -> bool:
        """Whether the chunk is in the snapshot: committed before it, not of a put in flight."""
        return chunk < self.before and chunk not in self.skip

    def landed(
        self, partition: str, chunk: int, row_ids: Sequence[int], columns: dict[str, Column]
    ) -> None:
        awaited = self.awaited.get(partition)
        if not awaited or not self.keep(chunk):
            return
        found = {row: i for i, row in enumerate(row_ids) if row in awaited}
        if found:
            self.held.setdefault(partition, {})[chunk] = (columns, found)
            awaited.difference_update(found)
            if not awaited:
                del self.awaited[partition]


class UnitCheckpoints:
    """The storage service's checkpoint requests. ``landings(partition)``: the futures of the
    partition's puts landing now, done once each is over; ``name()``: the unit, for errors."""

    def __init__(
        self,
        store: ColumnStore,
        landings: Callable[[str], list[asyncio.Future[None]]],
        name: Callable[[], str],
    ) -> None:
        self.store = store
        self._landings = landings
        self._name = name
        self._captures: set[_Capture] = set()

    def landed(
        self, partition: str, chunk: int, row_ids: Sequence[int], columns: dict[str, Column]
    ) -> None:
        """A direct put's columns reached the unit (call before applying drops noted on it)."""
        for capture in self._captures:
            capture.landed(partition, chunk, row_ids, columns)

    # --- save ---
    def save(self, msg: SaveUnit) -> Awaitable[UnitSaved]:
        """Capture now (this step), write later; see the module docstring."""
        capture = _Capture(msg)
        waits: list[asyncio.Future[None]] = []
        for partition, rows in msg.rows.items():
            held, missing = self.store.chunks_of(partition, rows, capture.keep)
            capture.held[partition] = held
            if missing:
                capture.awaited[partition] = set(missing)
                waits += self._landings(partition)
        if capture.awaited:
            self._captures.add(capture)
        return self._save(msg, capture, waits)

    async def _save(
        self, msg: SaveUnit, capture: _Capture, waits: list[asyncio.Future[None]]
    ) -> UnitSaved:
        try:
            if waits:
                await asyncio.wait(waits)
        finally:
            self._captures.discard(capture)
        if capture.awaited:
            partition, rows = next(iter(capture.awaited.items()))
            shown = ", ".join(map(str, sorted(rows)[:5]))
            raise CheckpointError(
                f"storage unit {self._name()} does not hold {len(rows)} rows of partition "
                f"{partition!r} that the controller placed on it (row ids {shown}); their data "
                f"is lost, so no checkpoint can include them: clear them (clear_samples) and save "
                f"again",
                partition=partition,
                rows=len(rows),
            )
        name = "tqstream-checkpoint-save"
        files = await in_thread(name, _write, msg.directory, capture.held)
        return UnitSaved(rid=msg.rid, files=files)

    # --- load ---
    def load(self, msg: LoadUnit) -> Awaitable[Ok]:
        return self._load(msg)

    async def _load(self, msg: LoadUnit) -> Ok:
        loaded = await in_thread("tqstream-checkpoint-load", _read, list(msg.files))
        added: list[int] = []
        try:
            for partition, chunks in loaded:
                # in id order, newest last: a field written again (put_fields with overwrite)
                # takes the value of its latest write, as it had when saved
                for chunk, rows, columns in sorted(chunks, key=lambda c: c[0]):
                    chunk_id = msg.chunk_base + chunk
                    self.store.add_chunk(partition, chunk_id, rows, columns, True, msg.generation)
                    self.store.publish(chunk_id)
                    added.append(chunk_id)
        except TQStreamError as exc:
            self.store.drop_chunks(added)  # all or nothing
            raise CheckpointError(
                f"storage unit {self._name()} cannot hold the checkpoint's chunks ({exc}); load "
                f"it into a fresh cluster",
            ) from None
        return Ok(rid=msg.rid, count=len(added))


def _read(paths: list[str]) -> list[tuple[str, list[Chunk]]]:
    return [read_chunks(path) for path in paths]


def _write(directory: str, held: dict[str, Held]) -> list[SavedFile]:
    """Write every partition's chunks under ``directory`` (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    files = []
    for index, (partition, chunks) in enumerate(held.items()):
        for n, group in enumerate(_pack(chunks)):
            part = [_materialize(chunk, *chunks[chunk]) for chunk in group]
            name = f"p{index}-{n}.chunks"
            nbytes = write_chunks(os.path.join(directory, name), partition, part)
            rows = sorted({row for _, chunk_rows, _ in part for row in chunk_rows})
            files.append(SavedFile(name=name, partition=partition, row_ids=rows, nbytes=nbytes))
    fsync_dir(directory)
    return files


def _materialize(chunk: int, columns: dict[str, Column], rows: dict[int, int]) -> Chunk:
    """The chunk's columns for its rows to save, in position order: the chunk's own columns
    when that is all of them (no copy), else the rows gathered."""
    order = sorted(rows, key=rows.__getitem__)
    positions = [rows[r] for r in order]
    n = next(iter(columns.values())).n_rows
    if positions == list(range(n)):
        return chunk, order, dict(columns)
    return chunk, order, {name: col.take(positions) for name, col in columns.items()}


def _pack(chunks: Held) -> list[list[int]]:
    """Chunk ids in files: chunks that share a row are in one group (union-find), and groups fill
    files of about ``FILE_BYTES``."""
    parent = {c: c for c in chunks}

    def root(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    first: dict[int, int] = {}  # row -> the first chunk seen holding it
    for chunk, (_, rows) in chunks.items():
        for row in rows:
            other = first.setdefault(row, chunk)
            if other != chunk:
                parent[root(chunk)] = root(other)
    groups: dict[int, list[int]] = {}
    for chunk in chunks:
        groups.setdefault(root(chunk), []).append(chunk)
    files: list[list[int]] = []
    size = FILE_BYTES
    for group in groups.values():
        if size >= FILE_BYTES:
            files.append([])
            size = 0
        files[-1] += group
        size += sum(_nbytes(*chunks[c]) for c in group)
    return files


def _nbytes(columns: dict[str, Column], rows: dict[int, int]) -> int:
    n = next(iter(columns.values())).n_rows
    return sum(col.nbytes for col in columns.values()) * len(rows) // max(n, 1)
