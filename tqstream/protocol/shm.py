"""Shared memory between a client and a storage unit on the same host.

A storage unit owns a *token* and names every segment it may serve ``tqs-<token>-...`` under
``/dev/shm``. Its ``Welcome`` carries the token; a client that can open the unit's probe segment and
read the token back shares its memory (same host, same ``/dev/shm``) and from then on moves tensor
bytes through segments instead of ZMQ frames, which then carry only the msgpack header:

* put: the client lays a chunk's buffers out in segment ``tqs-<token>-c<chunk>`` (one copy, also of
  a put's list of tensors: :mod:`~tqstream.protocol.parts`; a new segment or a claimed spare,
  below) and sends ``Store`` with the segment's regions; the unit maps the segment and keeps it as
  the chunk's memory until the chunk is dropped.
* direct put (``PutRows``, whose chunk id the controller picks only at the commit): the client
  writes ``tqs-<token>-d<random>``; the unit *takes* it by renaming it to a name of its own
  (``-l<n>``, atomic) before mapping it, and renames that to the chunk's name once committed. A
  client whose put failed unlinks its ``-d`` name: either the unit took the segment already (the
  unlink finds nothing) or it will find nothing to take and refuse the put. A ``-d`` segment whose
  client died before sending it is swept by the unit after ``ORPHAN_AGE``.
* get: the unit answers a ``Fetch`` with regions of the chunk segments when the rows sit in order in
  one chunk (zero copy); gathered data above ``GATHER_SEGMENT_BYTES`` is copied once into a segment
  of the client's (:class:`Receiver`): one it offers in the ``Fetch`` (``into``), or else a fresh
  ``tqs-<token>-g<n>`` that the client renames to ``tqs-<token>-r<n>``, its own, once mapped;
  smaller data goes as frames. A client offers a segment only once nobody else holds it (the
  write-lease check below: the views of an earlier get keep it mapped), so the pages of one get are
  written again for the next instead of allocated afresh.

Readers map segments copy-on-write (``MAP_PRIVATE``): tensors are views of the unit's pages, a write
to one touches a private copy of that page only, and the pages stay valid after the unit unlinks the
name; the kernel frees them when the last view is garbage. Segments of a unit that died without
cleaning up are removed by the next unit started on the host (its probe names the owner's pid).

Fresh shared pages are expensive (the kernel allocates and zeroes each one), so a dropped chunk's
segment is renamed ``tqs-<token>-p<n>`` and kept as a spare (a few, bounded in bytes) instead of
being unlinked. The unit lists its spares (name, size, inode) in its answer to a shared put; the
client's next put claims one by renaming it to its segment's name (atomic: one claimant wins) and
writes into pages that already exist. It writes a spare only once *nobody else has it open or
mapped* — checked with a write lease on its own descriptor, which the kernel grants only then (a
reader's mapping keeps the file open; so does the unit's while the chunk is stored) — so a
consumer's views are never overwritten.

A large segment's page tables cost more than the copy itself (populating and unmapping 64 MiB of
4 KiB pages: ~8 ms, the copy ~3 ms), so a client keeps its shared mappings of the large segments it
wrote (:class:`Writer`, bounded like the spares): when the unit offers one of them back as a spare,
the next put copies into the mapping it still has. Its open descriptor is what the lease check
sees, so nobody else claims a spare a client keeps; a kept segment the unit unlinked (a spare
evicted, the unit gone) is let go at the client's next large put.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import re
import secrets
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tqstream.errors import InvalidRequestError, MalformedMessageError, TQStreamError
from tqstream.protocol.messages import Region, Spare
from tqstream.protocol.parts import Parts, nbytes

__all__ = [
    "GATHER_SEGMENT_BYTES",
    "SHM_DIR",
    "Receiver",
    "Segments",
    "UnitSegments",
    "Writer",
    "available",
    "chunk_segment",
    "direct_segment",
    "process_key",
    "reachable",
    "remove_segments",
    "segment_size",
    "sweep_dead_units",
    "unlink",
    "write_segment",
]

SHM_DIR = "/dev/shm"
ALIGN = 64
GATHER_SEGMENT_BYTES = 1 << 20
"""Gathered fetch data at least this large goes through a fresh segment instead of frames."""
SPARE_SEGMENTS = 16
SPARE_BYTES = 1 << 30
"""At most this many recycled segments, of at most this many bytes in all, wait for reuse: a step
that writes several chunks (a batch and the columns added to it) recycles several at its clear,
and the batch's own must still be there when the next batch is put."""
MAPPED_WRITE_BYTES = 16 << 20
"""Segments at least this large are written through a mapping the writer keeps (:class:`Writer`),
smaller ones with ``write()``: a mapping's set-up costs more than it saves there when it is not
used again, and keeping mappings of every segment would hold pages nobody else could reuse."""
ORPHAN_AGE = 300.0
"""Seconds after which a unit unlinks a direct put's segment that no ``PutRows`` came for (its
client died between writing it and sending the put), and a client's receive segment written no
more (its client died, or stopped reading: it lets go of the segment then)."""
RECEIVE_SEGMENTS = 4
"""A client keeps at most this many receive segments per storage unit (and at most
``SPARE_BYTES`` of them), the least recently used let go first."""
_NAME = re.compile(r"tqs-[0-9a-f]{16}-[cglr][0-9]+")
_NAME_SPARE = re.compile(r"tqs-[0-9a-f]{16}-p[0-9]+")
_NAME_DIRECT = re.compile(r"tqs-[0-9a-f]{16}-d[0-9]+")
_NAME_RECEIVE = re.compile(r"tqs-[0-9a-f]{16}-r[0-9]+")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere the copy faults the pages in


def available() -> bool:
    """Whether this host has a writable POSIX shared-memory directory."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def chunk_segment(token: str, chunk: int) -> str:
    return f"tqs-{token}-c{chunk}"


def direct_segment(token: str) -> str:
    """A fresh name for a direct put's segment (``O_EXCL`` catches the unlikely clash)."""
    return f"tqs-{token}-d{secrets.randbits(62)}"


def unlink(name: str) -> None:
    """Remove a segment's name (mapped views keep its pages); a missing one is no error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


def reachable(token: str) -> bool:
    """Whether the unit that owns ``token`` shares this process's ``/dev/shm``."""
    if not token or not re.fullmatch(r"[0-9a-f]{16}", token):
        return False
    try:
        with open(_path(f"tqs-{token}-probe"), "rb") as f:
            return f.read(16) == token.encode()
    except OSError:
        return False


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, max(end, 1)


def segment_size(buffers: Sequence[Any]) -> int:
    """Bytes of the segment that holds ``buffers``."""
    return _layout([nbytes(b) for b in buffers])[1]


def write_segment(name: str, buffers: Sequence[Any]) -> list[Region]:
    """Write ``buffers`` (one copy each) into a new segment ``name``; return their regions. On
    failure (e.g. ``ENOSPC``: /dev/shm is full) nothing is left behind. A writer that puts again
    uses a :class:`Writer` (spares, kept mappings) instead."""
    sizes = [nbytes(b) for b in buffers]
    offsets, size = _layout(sizes)
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _reserve(fd, size)
        if size >= MAPPED_WRITE_BYTES:  # write() copies page by page: half the speed there
            mapped = _Kept(os.dup(fd), size)
            try:
                mapped.copy(buffers, offsets, sizes)
            finally:
                mapped.close()
        else:
            _pwrite(fd, buffers, offsets, sizes)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)
    return [Region(name, off, n) for off, n in zip(offsets, sizes, strict=True)]


def _reserve(fd: int, size: int) -> None:
    # reserve every page first: a full /dev/shm fails here, not with SIGBUS in a reader (a spare's
    # pages were reserved when it was made, and tmpfs keeps them)
    if os.fstat(fd).st_size < size:
        os.posix_fallocate(fd, 0, size)


def _pwrite(fd: int, buffers: Sequence[Any], offsets: Sequence[int], sizes: Sequence[int]) -> None:
    for buf, off, n in zip(buffers, offsets, sizes, strict=True):
        if type(buf) is Parts:  # a column's values in parts: staged, each part copied once
            buf.pwrite(fd, off)
            continue
        view = memoryview(buf).cast("B")
        while n:  # write() without a mapping of our own: no page-table work
            done = os.pwrite(fd, view, off)
            view, off, n = view[done:], off + done, n - done


class _Kept:
    """A writer's shared mapping of a segment it wrote, and the descriptor it was made from."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.inode = os.fstat(fd).st_ino
        # page tables made in one pass (MAP_POPULATE): cheaper than a fault per page in the copy
        self.mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        self.size = size

    def copy(self, buffers: Sequence[Any], offsets: Sequence[int], sizes: Sequence[int]) -> None:
        """Memory copies into the mapping (torch's, parallel, GIL released); a column's values in
        parts are copied there part by part (one ``torch.cat``)."""
        segment = torch.frombuffer(self.mapping, dtype=torch.uint8)
        with warnings.catch_warnings():  # the sources are read-only buffers, only ever read here
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for buf, off, n in zip(buffers, offsets, sizes, strict=True):
                if type(buf) is Parts:
                    buf.into(segment[off : off + n])
                elif n:
                    source = torch.frombuffer(memoryview(buf).cast("B"), dtype=torch.uint8)
                    segment[off : off + n].copy_(source)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a copy's view not collected yet: it goes later
            self.mapping.close()
        os.close(self.fd)


class Writer:
    """How a client writes segments: into a unit's spares when one fits (pages that exist), and
    through mappings it keeps for segments of ``MAPPED_WRITE_BYTES`` or more (see the module
    docstring), at most ``SPARE_SEGMENTS`` of them and ``SPARE_BYTES`` in all, the least recently
    written let go first. Smaller segments are written with ``write()``: a mapping's set-up costs
    more than it saves there. Not thread-safe: one client's loop uses it."""

    def __init__(self) -> None:
        self._kept: dict[int, _Kept] = {}  # inode -> kept mapping, least recently written first

    @property
    def kept_bytes(self) -> int:
        return sum(k.size for k in self._kept.values())

    def write(
        self, name: str, buffers: Sequence[Any], spares: list[Spare]
    ) -> tuple[list[Region], str, int]:
        """Write ``buffers`` into segment ``name`` (a claimed spare, renamed, or a new one); return
        the regions, the claimed spare's name ("" for a new segment) and the inode of the mapping
        kept (0: none), which :meth:`forget` must let go if the put fails. ``spares`` (the unit's,
        last heard) loses the one claimed. On failure nothing is left behind and nothing kept."""
        sizes = [nbytes(b) for b in buffers]
        offsets, size = _layout(sizes)
        self._let_go_unlinked()
        reused, fd, kept = self._claim(spares, name, size)
        spares[:] = [s for s in spares if s.name != reused]
        fresh: _Kept | None = None  # a mapping made for this write, kept once written
        try:
            if kept is None:
                if fd < 0:
                    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                _reserve(fd, size)
                if size >= MAPPED_WRITE_BYTES:
                    fresh = kept = _Kept(fd, max(size, os.fstat(fd).st_size))
                    fd = -1
                else:
                    _pwrite(fd, buffers, offsets, sizes)
            if kept is not None:
                kept.copy(buffers, offsets, sizes)
        except BaseException:
            unlink(name)
            if fresh is not None:
                fresh.close()
            elif kept is not None:
                self.forget(kept.inode)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        if fresh is not None:
            self._keep(fresh)  # let go at once if it alone is over the bound
        regions = [Region(name, off, n) for off, n in zip(offsets, sizes, strict=True)]
        return regions, reused, 0 if kept is None else kept.inode

    def _claim(
        self, spares: Sequence[Spare], name: str, size: int
    ) -> tuple[str, int, _Kept | None]:
        """Rename the smallest spare of ``size`` to ``2 * size`` bytes that nobody else holds to
        ``name``, those this writer keeps a mapping of first: (the spare's name, a descriptor
        of it or -1, the kept mapping or None); ("", -1, None) when none can be had."""
        fitting = [
            s for s in spares if size <= s.nbytes <= 2 * size and _NAME_SPARE.fullmatch(s.name)
        ]
        for spare in sorted(fitting, key=lambda s: (s.inode not in self._kept, s.nbytes)):
            kept = self._kept.get(spare.inode) if spare.inode else None
            if kept is not None:
                fd = kept.fd
            else:
                try:
                    fd = os.open(_path(spare.name), os.O_RDWR)
                except OSError:
                    continue  # claimed by another client, or evicted by the unit
            # nobody else may hold it: a reader's mapping, the unit's, another writer's
            claimed = _alone(fd) and _rename(spare.name, name)
            if kept is not None:
                if claimed:
                    self._kept[spare.inode] = self._kept.pop(spare.inode)  # most recent now
                    return spare.name, -1, kept
            elif claimed:
                return spare.name, fd, None
            else:
                os.close(fd)
        return "", -1, None

    def _keep(self, kept: _Kept) -> None:
        self._kept[kept.inode] = kept
        while len(self._kept) > SPARE_SEGMENTS or self.kept_bytes > SPARE_BYTES:
            self.forget(next(iter(self._kept)))

    def _let_go_unlinked(self) -> None:
        for inode, kept in list(self._kept.items()):
            if os.fstat(kept.fd).st_nlink == 0:  # the unit unlinked it: nobody offers it again
                self.forget(inode)

    def forget(self, inode: int) -> None:
        """Let the kept mapping of ``inode`` go (a put that wrote it failed: whether the unit took
        the segment is unknown, so it is never written again)."""
        kept = self._kept.pop(inode, None)
        if kept is not None:
            kept.close()

    def close(self) -> None:
        for inode in list(self._kept):
            self.forget(inode)


class Receiver:
    """A client's receive segments at one storage unit (see the module docstring): what a
    ``Fetch`` offers the unit to copy gathered rows into. Not thread-safe: one client's loop uses
    it."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._kept: dict[str, tuple[int, int]] = {}  # name -> (descriptor, size), LRU first
        self._busy: set[str] = set()  # offered to a Fetch not answered yet

    def offer(self) -> list[Spare]:
        """The segments nobody holds (no views of an earlier get alive, no Fetch in flight),
        marked busy until :meth:`done` or :meth:`failed`."""
        out = []
        for name, (fd, size) in list(self._kept.items()):
            if name in self._busy:
                continue
            if os.fstat(fd).st_nlink == 0:  # swept by the unit: nobody can write it any more
                self._drop(name)
            elif _alone(fd):
                self._busy.add(name)
                out.append(Spare(name, size))
        return out

    def done(self, offered: Sequence[Spare], regions: Sequence[Region]) -> None:
        """A Fetch that offered ``offered`` was answered with ``regions`` (already mapped): the
        offered segments are free again, the one written is the most recently used, and a fresh
        gather segment becomes a receive segment of ours."""
        for spare in offered:
            self._busy.discard(spare.name)
        for name in dict.fromkeys(r.name for r in regions):
            if name in self._kept:
                self._kept[name] = self._kept.pop(name)
            elif name.startswith(f"tqs-{self.token}-g"):
                self._adopt(name)

    def failed(self, offered: Sequence[Spare]) -> None:
        """A Fetch that offered ``offered`` failed or timed out: the unit may still write them,
        so they are never offered again."""
        for spare in offered:
            self._busy.discard(spare.name)
            self._drop(spare.name)

    def _adopt(self, name: str) -> None:
        mine = f"tqs-{self.token}-r{secrets.randbits(62)}"
        if not _rename(name, mine):
            unlink(name)
            return
        try:
            fd = os.open(_path(mine), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            unlink(mine)
            return
        self._kept[mine] = (fd, os.fstat(fd).st_size)
        while len(self._kept) > RECEIVE_SEGMENTS or sum(s for _, s in self._kept.values()) > (
            SPARE_BYTES
        ):
            oldest = next((n for n in self._kept if n not in self._busy), None)
            if oldest is None:
                break
            self._drop(oldest)

    def _drop(self, name: str) -> None:
        entry = self._kept.pop(name, None)
        if entry is not None:
            unlink(name)  # views of earlier gets keep their pages
            os.close(entry[0])

    def close(self) -> None:
        for name in list(self._kept):
            self._drop(name)
        self._busy.clear()


def _rename(old: str, new: str) -> bool:
    try:
        os.rename(_path(old), _path(new))
    except OSError:
        return False
    return True


def _map(name: str) -> mmap.mmap:
    """A copy-on-write mapping of segment ``name`` (the caller validated the name)."""
    fd = os.open(_path(name), os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class Segments:
    """Maps the segments one message refers to, each once; ``views`` are memoryviews that keep
    their mapping alive (and so do tensors built on them)."""

    def __init__(self, token: str, missing: type[TQStreamError] = MalformedMessageError) -> None:
        """``missing``: the error for a segment that does not exist (a client raises
        UnknownRowError: the rows were dropped between the unit's answer and the mapping)."""
        self.token = token
        self.missing = missing
        self._maps: dict[str, mmap.mmap] = {}

    def mapping(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is None:
            if not _NAME.fullmatch(name) or not name.startswith(f"tqs-{self.token}-"):
                raise MalformedMessageError(
                    f"shared-memory segment {name!r} is not one of this storage unit's "
                    f"(tqs-{self.token}-c<chunk>, -g<n> or -r<n>)",
                    segment=name,
                )
            try:
                mm = self._maps[name] = _map(name)
            except FileNotFoundError:
                raise self.missing(
                    f"shared-memory segment {name!r} does not exist: its rows were dropped (e.g. "
                    "cleared while being fetched), or it was never written",
                    segment=name,
                ) from None
        return mm

    def view(self, region: Region) -> memoryview:
        mm = self.mapping(region.name)
        if region.offset < 0 or region.nbytes < 0 or region.offset + region.nbytes > len(mm):
            raise MalformedMessageError(
                f"region [{region.offset}, +{region.nbytes}) lies outside segment "
                f"{region.name!r} of {len(mm)} bytes",
                segment=region.name,
            )
        return memoryview(mm)[region.offset : region.offset + region.nbytes]

    def forget(self, name: str) -> mmap.mmap | None:
        """Stop holding ``name``'s mapping (views keep it alive) and return it, if mapped."""
        return self._maps.pop(name, None)


def _address(buffer: Any) -> int:
    view = memoryview(buffer)
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data)


class UnitSegments:
    """A storage unit's segments: its probe, the chunk segments it maps, and lookups from a
    buffer's address back to (segment, offset) so fetched views can be answered as regions."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        sweep_dead_units()
        probe = _path(f"tqs-{self.token}-probe")
        with open(probe, "xb") as f:
            f.write(f"{self.token} {os.getpid()} {process_key()}".encode())
        self.reader = Segments(self.token)
        self._bases: list[int] = []  # sorted start addresses of the mapped chunk segments
        self._spans: dict[int, tuple[int, str]] = {}  # start -> (end, name)
        self._chunk_names: dict[int, tuple[str, int, int]] = {}  # chunk -> (name, start, size)
        self._spares: dict[str, tuple[int, int]] = {}  # segment -> (size, inode), oldest first
        self._taken: dict[str, tuple[int, int]] = {}  # direct puts' segments -> (start, size)
        self._counter = 0
        self._next_sweep = time.monotonic() + ORPHAN_AGE

    def adopt(self, chunk: int, regions: Sequence[Region]) -> list[memoryview]:
        """Map the chunk segment a client wrote; the returned views become the chunk's frames."""
        name = chunk_segment(self.token, chunk)
        if chunk in self._chunk_names:
            raise MalformedMessageError(
                f"chunk {chunk} is already stored; the same Store must not be applied twice",
                chunk=chunk,
            )
        if any(r.name != name for r in regions):
            raise MalformedMessageError(
                f"a Store of chunk {chunk} must name segment {name!r}, got "
                f"{sorted({r.name for r in regions})}",
                chunk=chunk,
            )
        views, mm = self._map_views(name, regions)
        self._register(chunk, name, _address(mm), len(mm))
        return views

    def take(self, regions: Sequence[Region], reused: str) -> tuple[str, list[memoryview]]:
        """Take over the segment a client wrote for a direct put (see the module docstring):
        renamed to a name of ours, mapped; return that name and the views (the put's frames).
        :meth:`landed` makes it the chunk's memory, :meth:`untake` gives it up."""
        if reused:
            self.claimed(reused)
        names = sorted({r.name for r in regions})
        if (
            len(names) != 1
            or not _NAME_DIRECT.fullmatch(names[0])
            or not names[0].startswith(f"tqs-{self.token}-")
        ):
            raise MalformedMessageError(
                f"a direct put names one segment tqs-{self.token}-d<n>, got {names}",
                segments=names,
            )
        self._counter += 1
        name = f"tqs-{self.token}-l{self._counter}"
        try:
            os.rename(_path(names[0]), _path(name))
        except FileNotFoundError:
            raise InvalidRequestError(
                f"shared-memory segment {names[0]!r} of the put does not exist: its client gave "
                f"up on the put (and removed it), or it was never written; put again",
                segment=names[0],
            ) from None
        try:
            views, mm = self._map_views(name, [Region(name, r.offset, r.nbytes) for r in regions])
        except BaseException:
            unlink(name)
            raise
        self._taken[name] = (_address(mm), len(mm))
        return name, views

    def landed(self, chunk: int, taken: str) -> None:
        """The direct put whose segment :meth:`take` took was committed as ``chunk``."""
        start, size = self._taken.pop(taken)
        name = chunk_segment(self.token, chunk)
        os.rename(_path(taken), _path(name))
        self._register(chunk, name, start, size)

    def untake(self, taken: str) -> None:
        """The direct put whose segment :meth:`take` took stores nothing: recycle it."""
        entry = self._taken.pop(taken, None)
        if entry is not None and not self._recycle(taken, entry[1]):
            unlink(taken)

    def _map_views(self, name: str, regions: Sequence[Region]) -> tuple[list[memoryview], Any]:
        try:
            views = [self.reader.view(r) for r in regions]
        finally:
            mm = self.reader.forget(name)  # a refused message keeps no mapping
        assert mm is not None
        return views, mm

    def _register(self, chunk: int, name: str, start: int, size: int) -> None:
        self._spans[start] = (start + size, name)
        bisect.insort(self._bases, start)
        self._chunk_names[chunk] = (name, start, size)

    @property
    def spare_bytes(self) -> int:
        return sum(size for size, _ in self._spares.values())

    def claimed(self, spare: str) -> None:
        """A client renamed ``spare`` for one of its chunks: it is no longer ours to offer."""
        self._spares.pop(spare, None)

    def holds(self, chunk: int) -> bool:
        """Whether the chunk was stored through shared memory (``adopt``) and not released."""
        return chunk in self._chunk_names

    def release(self, chunk: int) -> None:
        """The chunk was dropped (or never stored). Call it once the chunk's tensors are gone: its
        segment is recycled if nobody else has it open or mapped, else its name is unlinked
        (views already handed out keep their pages until they die)."""
        entry = self._chunk_names.pop(chunk, None)
        if entry is None:
            unlink(chunk_segment(self.token, chunk))  # written by a client, never adopted
            return
        name, start, size = entry
        del self._spans[start]
        self._bases.pop(bisect.bisect_left(self._bases, start))
        if not self._recycle(name, size):
            unlink(name)

    def _recycle(self, name: str, size: int) -> bool:
        if size > SPARE_BYTES:
            return False
        self._counter += 1
        spare = f"tqs-{self.token}-p{self._counter}"
        try:
            os.rename(_path(name), _path(spare))
        except OSError:
            return False
        try:
            inode = os.stat(_path(spare)).st_ino
        except OSError:  # no inode: only its writer's kept mapping goes unused
            inode = 0
        self._spares[spare] = (size, inode)
        while len(self._spares) > SPARE_SEGMENTS or self.spare_bytes > SPARE_BYTES:
            oldest = next(iter(self._spares))
            unlink(oldest)
            del self._spares[oldest]
        return True

    def spares(self) -> list[Spare]:
        """The recycled segments, minus those a client claimed since; readers may still map some
        (a claimant checks that nobody holds the one it takes)."""
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + ORPHAN_AGE
            self.sweep_orphans()
        for name in list(self._spares):
            if not os.path.exists(_path(name)):
                del self._spares[name]
        return [Spare(name, size, inode) for name, (size, inode) in self._spares.items()]

    def sweep_orphans(self, age: float = ORPHAN_AGE) -> int:
        """Unlink the direct puts' segments older than ``age`` seconds that nobody took (their
        client died before sending the put), and the receive segments not written for as long
        (their client died or stopped reading); return how many."""
        prefixes, now, swept = (f"tqs-{self.token}-d", f"tqs-{self.token}-r"), time.time(), 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(SHM_DIR):
                if not entry.name.startswith(prefixes):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    if now - max(st.st_mtime, st.st_ctime) > age:
                        unlink(entry.name)
                        swept += 1
        return swept

    def region(self, buffer: Any) -> Region | None:
        """Where ``buffer`` lies inside a chunk segment, or None."""
        n = memoryview(buffer).nbytes
        addr = _address(buffer)
        i = bisect.bisect_right(self._bases, addr) - 1
        if n == 0 or i < 0:
            return None
        start = self._bases[i]
        end, name = self._spans[start]
        return Region(name, addr - start, n) if addr + n <= end else None

    def gather_segment(self, buffers: Sequence[Any], into: Sequence[Spare] = ()) -> list[Region]:
        """Copy ``buffers`` into the smallest fitting receive segment the client offered
        (``into``), or else into a fresh segment ``tqs-<token>-g<n>``; return their regions."""
        sizes = [nbytes(b) for b in buffers]
        offsets, size = _layout(sizes)
        for offer in sorted(into, key=lambda o: o.nbytes):
            if offer.nbytes < size or not offer.name.startswith(f"tqs-{self.token}-r"):
                continue
            if not _NAME_RECEIVE.fullmatch(offer.name):
                continue
            try:
                fd = os.open(_path(offer.name), os.O_RDWR | os.O_NOFOLLOW)
            except OSError:
                continue  # let go by its client, or swept
            try:
                if os.fstat(fd).st_size < size:
                    continue
                _pwrite(fd, buffers, offsets, sizes)  # its pages exist: no allocation
            finally:
                os.close(fd)
            return [Region(offer.name, off, n) for off, n in zip(offsets, sizes, strict=True)]
        self._counter += 1
        return write_segment(f"tqs-{self.token}-g{self._counter}", buffers)

    def close(self) -> None:
        """Unlink every name this unit owns (mapped views stay valid)."""
        remove_segments(self.token)


def _alone(fd: int) -> bool:
    """Whether no open file or mapping but ``fd``'s own holds its file: the kernel grants a write
    lease only then (a reader's mapping keeps a file open, a writer's mapping made from ``fd``
    is ``fd``'s own)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False


def remove_segments(token: str) -> None:
    """Unlink every name of unit ``token``'s segments (mapped views keep their pages)."""
    prefix = f"tqs-{token}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM_DIR):
            if entry.name.startswith(prefix):
                unlink(entry.name)


def process_key() -> str:
    """Which kernel and PID namespace this process's pid is valid in: another process with the
    same key can watch it with ``os.kill(pid, 0)``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""  # not Linux: pids are all there is


def sweep_dead_units() -> int:
    """Remove the segments of units on this host whose process is gone; return how many units'.

    Only probes written in this process's kernel and PID namespace count: a container that shares
    ``/dev/shm`` but not our pids cannot tell its live units from dead ones, so it leaves them."""
    here = process_key()
    swept = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM_DIR):
            m = re.fullmatch(r"tqs-([0-9a-f]{16})-probe", entry.name)
            if m is None:
                continue
            try:
                with open(entry.path, "rb") as f:
                    _, pid, *key = f.read(256).decode().split()
                    alive = (key[0] if key else "") != here or _alive(int(pid))
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            if not alive:
                remove_segments(m.group(1))
                swept += 1
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
