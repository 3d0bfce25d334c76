"""A checkpoint file of a storage unit: chunks of one partition, as they are held in memory.

Layout: an 8-byte magic, the header's length (uint64, little-endian), the msgpack
:class:`FileHeader`, zero padding to a multiple of ``ALIGN``, then each chunk's bytes. A chunk's
tensors lie at ``ALIGN``-aligned offsets of its own region, described by the same
:class:`~tqstream.protocol.messages.ColumnRef` s that carry them on the wire (one frame, with
offsets), so writing and reading reuse the wire encoding (:mod:`tqstream.protocol.wire`): no pickle,
no per-row objects. Each region has a CRC-32, checked when it is read back.

A chunk is read into a buffer of its own, so a loaded chunk pins only its own bytes, as a chunk
received from a client does.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from tqstream.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointVersionError
from tqstream.protocol.columns import Column
from tqstream.protocol.disk import write_durably
from tqstream.protocol.messages import BufferRef, ColumnRef
from tqstream.protocol.wire import column_from_wire, column_to_wire

__all__ = ["FORMAT", "Chunk", "read_chunks", "write_chunks"]

FORMAT = 1
MAGIC = b"TQSCHNK\x00"
ALIGN = 64
_LENGTH = struct.Struct("<Q")


class ChunkEntry(msgspec.Struct, frozen=True):
    chunk: int
    row_ids: list[int]
    columns: list[ColumnRef]  # frame 1 with offsets: the chunk's region
    offset: int  # of the region, from the end of the header's padding
    length: int
    crc32: int


class FileHeader(msgspec.Struct, frozen=True):
    format: int
    partition: str
    chunks: list[ChunkEntry]


Chunk = tuple[int, list[int], dict[str, Column]]
"""(chunk id, row ids, columns): what a file holds and what a unit stores."""

_ZEROS = bytes(ALIGN)


def _pad(n: int) -> int:
    return -n % ALIGN


def write_chunks(path: str, partition: str, chunks: Sequence[Chunk]) -> int:
    """Write ``chunks`` of ``partition`` to the new file ``path`` and fsync it; returns the bytes
    of row data written (the tensors' bytes, as a storage unit counts them)."""
    entries: list[ChunkEntry] = []
    regions: list[list[Any]] = []  # the buffers of each region, zero padding included
    offset = data = 0
    for chunk_id, row_ids, columns in chunks:
        refs, parts, at, crc = [], [], 0, 0
        for name, col in columns.items():
            ref, buffers = column_to_wire(name, col, 1)
            placed = []
            for buf in buffers:
                placed.append(at)
                pad = _ZEROS[: _pad(buf.nbytes)]
                parts += [buf, pad]
                crc = zlib.crc32(pad, zlib.crc32(buf, crc))
                at += buf.nbytes + len(pad)
                data += buf.nbytes
            values = BufferRef(1, ref.values.dtype, ref.values.shape, placed[0])
            offsets = None
            if ref.offsets is not None:
                offsets = BufferRef(1, "int64", ref.offsets.shape, placed[1])
            refs.append(ColumnRef(name, ref.schema, values, offsets))
        entries.append(ChunkEntry(chunk_id, list(row_ids), refs, offset, at, crc))
        regions.append(parts)
        offset += at
    header = msgspec.msgpack.encode(FileHeader(FORMAT, partition, entries))
    head = MAGIC + _LENGTH.pack(len(header)) + header
    head += _ZEROS[: _pad(len(head))]

    def contents() -> Iterator[Any]:
        yield head
        for region in regions:
            yield from region

    write_durably(path, contents())
    return data


def read_chunks(path: str) -> tuple[str, list[Chunk]]:
    """The partition and chunks of a file written by :func:`write_chunks`, each chunk in memory
    of its own; a missing file raises ``CheckpointNotFoundError``, anything that does not check
    out ``CheckpointCorruptError``."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the open error is the one to report)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"checkpoint file {path} does not exist: the checkpoint is incomplete, or its storage "
            f"units' files are on another filesystem (with storage units on several hosts, save "
            f"and load on a filesystem they all share)",
            path=path,
        ) from None
    except OSError as exc:
        raise CheckpointCorruptError(
            f"cannot read checkpoint file {path}: {exc}", path=path
        ) from exc
    with f:
        head = f.read(len(MAGIC) + _LENGTH.size)
        if len(head) < len(MAGIC) + _LENGTH.size or head[: len(MAGIC)] != MAGIC:
            raise _corrupt(path, "it does not start like a tqstream chunk file")
        (size,) = _LENGTH.unpack(head[len(MAGIC) :])
        raw = f.read(size)
        try:
            header = msgspec.msgpack.decode(raw, type=FileHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _corrupt(path, f"its header does not decode ({exc})") from None
        if header.format != FORMAT:
            raise CheckpointVersionError(
                f"checkpoint file {path} has chunk format {header.format}; this tqstream reads "
                f"format {FORMAT}: load it with the tqstream version that saved it",
                path=path,
            )
        base = len(head) + size + _pad(len(head) + size)
        chunks = []
        for e in header.chunks:
            buf = bytearray(e.length)
            f.seek(base + e.offset)
            if f.readinto(buf) != e.length:
                raise _corrupt(path, f"chunk {e.chunk} is cut short (the file is truncated)")
            if zlib.crc32(buf) != e.crc32:
                raise _corrupt(path, f"chunk {e.chunk} fails its CRC-32 check")
            try:
                n, frames = len(e.row_ids), [b"", buf]
                columns = {ref.name: column_from_wire(ref, frames, n) for ref in e.columns}
            except Exception as exc:  # MalformedMessageError, or a shape numpy refuses
                raise _corrupt(path, f"chunk {e.chunk} does not decode ({exc})") from None
            chunks.append((e.chunk, list(e.row_ids), columns))
    return header.partition, chunks


def _corrupt(path: str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint file {path} is not readable: {problem}; the checkpoint is damaged, save a "
        f"new one or load an older one",
        path=path,
    )
