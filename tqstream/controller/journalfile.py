"""The journal's files: the framing of records, segments and snapshots, and recovery on open.
Pure file work (no loop, no threads); :mod:`tqstream.controller.journal` drives it.

One directory per controller (a ``LOCK`` file is held with ``flock`` while it is open)::

    journal-<first seq, 20 digits>.tqj   a segment: prelude, then records
    snapshot-<base seq, 20 digits>.tqs   a snapshot: prelude, then its payload
    prelude   magic (8) | format u16 | 0 u16 | n u32 | header (msgpack, n bytes) | CRC-32 u32
    record    length u32 | kind u16 | check u16 | CRC-32 u32 | payload (length bytes)

Integers are little-endian. Records are numbered from 1 (``seq``), consecutively across segments;
a segment's header names its cluster and first seq, a snapshot's its cluster and the last seq it
stands for (its *base*) with the payload's size and CRC-32. A record's ``check`` is the low 16
bits of the CRC-32 of its length and kind, and its CRC-32 covers those too, then the payload: a
damaged length is caught as damage instead of being read as a record cut short at the end.

Recovery reads the newest snapshot, then the chain of segments after its base. A bad record that
reaches the end of the last segment (cut short, the last one failing its CRC-32, zeros to the
end) is a torn write: it is cut off and its bytes reported, never replayed. Anything else bad
(damage with records after it, a segment that does not continue where the one before ended, a
damaged snapshot) raises :class:`JournalCorruptError`; a file of another format or cluster
:class:`JournalVersionError` / :class:`JournalClusterError`, naming both. Snapshots land whole or
not at all (written aside, fsynced, renamed, directory fsynced); only then are the files they
stand for deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import struct
import time
import zlib
from collections.abc import Iterator

import msgspec

from tqstream.errors import (
    JournalClusterError,
    JournalCorruptError,
    JournalError,
    JournalVersionError,
)
from tqstream.protocol.disk import fsync_dir, write_durably

__all__ = [
    "FORMAT",
    "MAX_PAYLOAD",
    "Replay",
    "Segment",
    "create_segment",
    "frame_into",
    "lock",
    "recover",
    "remove_covered",
    "write_all",
    "write_snapshot",
]

FORMAT = 1
"""Version of the files' layout; a journal of another version is refused, not guessed at."""


SEGMENT_MAGIC = b"TQSJRNL\n"
SNAPSHOT_MAGIC = b"TQSSNAP\n"
_PRELUDE = struct.Struct("<8sHHI")  # magic, format, 0, header length
_FRAME = struct.Struct("<IHHI")  # payload length, kind, check, CRC-32
_LENGTH_KIND = struct.Struct("<IH")
_CRC = struct.Struct("<I")
MAX_PAYLOAD = (1 << 32) - 1
_SEGMENT = re.compile(r"journal-(\d{20})\.tqj")
_SNAPSHOT = re.compile(r"snapshot-(\d{20})\.tqs")


class Header(msgspec.Struct, frozen=True):
    """A file's header, after the fixed prelude (fields may be added, with defaults)."""

    cluster: str
    seq: int  # a segment's first record; the last record a snapshot covers
    created: float = 0.0
    nbytes: int = 0  # a snapshot's payload
    crc: int = 0


class Replay:
    """What opening a journal found: the newest snapshot's payload (None: there is none) and
    the records after its base, in order. Payloads are views into files read whole: decode them
    (msgspec reads memoryviews) and drop them; nothing is copied."""

    def __init__(
        self,
        snapshot: memoryview | None,
        base: int,
        last: int,
        parts: list[tuple[bytes, int, int, int]],
        dropped_bytes: int,
    ) -> None:
        self.snapshot = snapshot
        self.base = base
        """The last record the snapshot covers (0: no snapshot)."""
        self.last = last
        """The last record replayed (``base`` when none follow it)."""
        self.dropped_bytes = dropped_bytes
        """Bytes of a torn tail that opening cut off (0: the journal ended whole)."""
        self._parts = parts  # per segment: (data, first frame, end, records at or below base)

    def __len__(self) -> int:
        return self.last - self.base

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        """``(kind, payload)`` of records ``base + 1 .. last`` (checksums were checked on open)."""
        unpack = _FRAME.unpack_from
        for data, offset, end, skip in self._parts:
            view = memoryview(data)
            while offset < end:
                length, kind, _, _ = unpack(data, offset)
                start = offset + _FRAME.size
                offset = start + length
                if skip:
                    skip -= 1
                else:
                    yield kind, view[start:offset]


class Segment:
    """An open segment: its descriptor, first seq and size written so far."""

    __slots__ = ("dir_synced", "fd", "first", "path", "size")

    def __init__(self, path: str, fd: int, first: int, size: int, dir_synced: bool) -> None:
        self.path, self.fd, self.first, self.size = path, fd, first, size
        self.dir_synced = dir_synced  # its directory entry fsynced (else the next fsync does it)


def frame_into(buf: bytearray, kind: int, payload: bytes | bytearray | memoryview) -> None:
    """Append one framed record to ``buf``."""
    n = len(payload)
    check = zlib.crc32(_LENGTH_KIND.pack(n, kind))
    buf += _FRAME.pack(n, kind, check & 0xFFFF, zlib.crc32(payload, check))
    buf += payload


def write_all(fd: int, data: bytearray) -> None:
    """All of ``data`` (a write may take less than asked when the disk fills up)."""
    view, done = memoryview(data), 0
    while done < len(view):
        n = os.write(fd, view[done:])
        if n <= 0:
            raise OSError(errno.ENOSPC, "no progress writing the journal")
        done += n


def lock(directory: str) -> int:
    """The descriptor holding the directory's ``LOCK`` (released when it is closed, or when the
    process dies: a restarted controller finds it free)."""
    fd = os.open(os.path.join(directory, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise JournalError(
            f"the journal at {directory} is open in another controller (its LOCK file is "
            f"held); each controller needs a journal directory of its own",
            directory=directory,
        ) from None
    return fd


def _prelude(magic: bytes, header: Header) -> bytes:
    body = msgspec.msgpack.encode(header)
    head = _PRELUDE.pack(magic, FORMAT, 0, len(body)) + body
    return head + _CRC.pack(zlib.crc32(head))


def _read_prelude(
    data: bytes, path: str, magic: bytes, cluster: str, torn_ok: bool
) -> tuple[Header, int] | None:
    """The header and where the file's body starts; None for a prelude cut short (``torn_ok``:
    a crash while the segment was being started)."""
    what = "segment" if magic == SEGMENT_MAGIC else "snapshot"
    if len(data) < _PRELUDE.size:
        if torn_ok:
            return None
        raise JournalCorruptError(f"the journal {what} {path} is cut short ({len(data)} bytes)")
    got, version, _, n = _PRELUDE.unpack_from(data)
    if got != magic:
        raise JournalCorruptError(
            f"{path} is not a tqstream journal {what} (it starts with {got!r})", path=path
        )
    if version != FORMAT:
        raise JournalVersionError(
            f"the journal {what} {path} is in journal format {version}; this tqstream reads "
            f"format {FORMAT}: open it with the tqstream version that wrote it, or move the "
            f"journal directory away to start empty",
            path=path,
            format=version,
            expected=FORMAT,
        )
    end = _PRELUDE.size + n + _CRC.size
    if len(data) < end:
        if torn_ok:
            return None
        raise JournalCorruptError(f"the journal {what} {path} is cut short inside its header")
    if _CRC.unpack_from(data, end - _CRC.size)[0] != zlib.crc32(memoryview(data)[: end - 4]):
        raise JournalCorruptError(f"the header of the journal {what} {path} fails its CRC-32")
    try:
        header = msgspec.msgpack.decode(memoryview(data)[_PRELUDE.size : end - 4], type=Header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise JournalCorruptError(
            f"the journal {what} {path} has an unreadable header ({exc})", path=path
        ) from None
    if header.cluster != cluster:
        raise JournalClusterError(
            f"the journal at {os.path.dirname(path)} belongs to cluster {header.cluster!r}, not "
            f"to this controller's cluster {cluster!r}: give this controller a journal "
            f"directory of its own, or restart cluster {header.cluster!r} with its identity",
            path=path,
            cluster=cluster,
            journal_cluster=header.cluster,
        )
    return header, end


def _scan(data: bytes, offset: int, path: str, first: int, last_file: bool) -> tuple[int, int]:
    """(records, end of the last whole one) from ``offset``, every checksum checked. A bad record
    that reaches the end of the file (cut short, or failing its CRC-32 as the last one, or zeros
    to the end) is a torn tail, allowed in the journal's last file only; anything else is
    damage."""
    end, n = len(data), 0
    view = memoryview(data)
    unpack, crc = _FRAME.unpack_from, zlib.crc32
    while offset < end:
        if end - offset < _FRAME.size:
            problem, damage = "a record header cut short", False
        else:
            length, _, check, want = unpack(data, offset)
            h = crc(view[offset : offset + _LENGTH_KIND.size])
            stop = offset + _FRAME.size + length
            if h & 0xFFFF != check:
                problem = "a record header that fails its check"
                damage = view[offset:] != bytes(end - offset)
            elif stop > end:
                problem, damage = "a record cut short", False
            elif crc(view[offset + _FRAME.size : stop], h) != want:
                problem, damage = "a record that fails its CRC-32", stop < end
            else:
                offset = stop
                n += 1
                continue
        if damage:
            raise JournalCorruptError(
                f"the journal segment {path} is damaged at byte {offset} (record {first + n}): "
                f"{problem}, with {end - offset} bytes from it to the end; a torn write damages "
                f"only the last record, so this is not one: restore the journal directory from a "
                f"copy, or move it away to start empty",
                path=path,
                offset=offset,
                seq=first + n,
            )
        if not last_file:
            raise JournalCorruptError(
                f"the journal segment {path} ends in {problem} at byte {offset} (record "
                f"{first + n}), and later segments follow it",
                path=path,
                offset=offset,
                seq=first + n,
            )
        return n, offset
    return n, offset


def recover(directory: str, cluster: str) -> tuple[Replay, tuple[str, int, int] | None]:
    """The replay (newest snapshot, then the chain of segments after it) and the last segment
    (path, first seq, last seq), its torn tail cut off. Files the snapshot covers are deleted."""
    snapshots, segments = [], []
    for name in os.listdir(directory):
        if name.endswith(".tmp"):  # a snapshot that never landed
            os.unlink(os.path.join(directory, name))
        elif m := _SNAPSHOT.fullmatch(name):
            snapshots.append(int(m[1]))
        elif m := _SEGMENT.fullmatch(name):
            segments.append(int(m[1]))
    snapshots.sort()
    segments.sort()
    base, payload = 0, None
    if snapshots:
        base = snapshots[-1]
        payload = _read_snapshot(os.path.join(directory, _snapshot_name(base)), cluster, base)
    starts = [i for i, first in enumerate(segments) if first <= base + 1]
    chain = segments[starts[-1] :] if starts else segments
    parts: list[tuple[bytes, int, int, int]] = []
    seq, dropped, tail = base, 0, None
    for i, first in enumerate(chain):
        path = os.path.join(directory, _segment_name(first))
        last_file = i == len(chain) - 1
        with open(path, "rb") as f:
            data = f.read()
        found = _read_prelude(data, path, SEGMENT_MAGIC, cluster, torn_ok=last_file)
        if found is None:  # the crash came while it was being started
            dropped += len(data)
            os.unlink(path)
            break
        header, start = found
        if header.seq != first:
            raise JournalCorruptError(
                f"the journal segment {path} says it starts at record {header.seq}, its name "
                f"at record {first}",
                path=path,
            )
        if first > seq + 1 or (i and first != seq + 1):
            raise JournalCorruptError(
                f"the journal at {directory} lacks records: after record {seq} comes segment "
                f"{path} starting at record {header.seq}",
                path=path,
                seq=seq,
            )
        n, end = _scan(data, start, path, first, last_file)
        if end < len(data):
            dropped += len(data) - end
            os.truncate(path, end)
            fd = os.open(path, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        parts.append((data, start, end, max(0, min(n, base + 1 - first))))
        seq = max(seq, first + n - 1)
        tail = (path, first, first + n - 1)
    remove_covered(directory, base, keep_from=chain[0] if chain else None)
    return Replay(payload, base, seq, parts, dropped), tail


def remove_covered(directory: str, base: int, keep_from: int | None = None) -> None:
    """Delete older snapshots and the segments before ``keep_from`` (default: every segment
    starting at or below ``base``, which holds nothing after it)."""
    for name in os.listdir(directory):
        if m := _SNAPSHOT.fullmatch(name):
            old = int(m[1]) < base
        elif m := _SEGMENT.fullmatch(name):
            old = int(m[1]) < keep_from if keep_from is not None else int(m[1]) <= base
        else:
            continue
        if old:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def _segment_name(first: int) -> str:
    return f"journal-{first:020d}.tqj"


def _snapshot_name(base: int) -> str:
    return f"snapshot-{base:020d}.tqs"


def create_segment(directory: str, cluster: str, first: int) -> Segment:
    path = os.path.join(directory, _segment_name(first))
    prelude = _prelude(SEGMENT_MAGIC, Header(cluster, first, time.time()))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, bytearray(prelude))
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return Segment(path, fd, first, len(prelude), False)


def _read_snapshot(path: str, cluster: str, base: int) -> memoryview:
    with open(path, "rb") as f:
        data = f.read()
    found = _read_prelude(data, path, SNAPSHOT_MAGIC, cluster, torn_ok=False)
    assert found is not None
    header, start = found
    payload = memoryview(data)[start:]
    if header.seq != base or len(payload) != header.nbytes or zlib.crc32(payload) != header.crc:
        raise JournalCorruptError(
            f"the journal snapshot {path} is damaged: {len(payload)} bytes (CRC-32 "
            f"{zlib.crc32(payload)}) where its header says {header.nbytes} (CRC-32 "
            f"{header.crc}) and record {header.seq}",
            path=path,
        )
    return payload


def write_snapshot(directory: str, cluster: str, base: int, payload: bytes) -> None:
    """On a thread: write, fsync, rename into place, fsync the directory; then delete what the
    snapshot covers (older snapshots, segments starting at or below ``base``)."""
    path = os.path.join(directory, _snapshot_name(base))
    tmp = f"{path}.tmp"
    header = Header(cluster, base, time.time(), len(payload), zlib.crc32(payload))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        write_durably(tmp, [_prelude(SNAPSHOT_MAGIC, header), payload])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    remove_covered(directory, base)
    fsync_dir(directory)
