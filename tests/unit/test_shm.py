"""The shared-memory helpers on their own: segment writing and its failure cleanup, spare claiming,
the exclusivity check, the unit's bookkeeping, and the client's and unit's refusals."""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from collections.abc import Iterator

import pytest
import torch
import zmq

import tqstream
from tqstream.client.core import _shared_frames
from tqstream.config import StorageConfig
from tqstream.convert.inputs import columns_from_data
from tqstream.protocol import shm
from tqstream.protocol.messages import Region, Spare, Store
from tqstream.protocol.wire import columns_to_wire
from tqstream.storage.service import StorageService

pytestmark = pytest.mark.skipif(
    not shm.available(), reason=f"needs a writable POSIX shared-memory directory ({shm.SHM_DIR})"
)


@pytest.fixture
def unit() -> Iterator[shm.UnitSegments]:
    segments = shm.UnitSegments()
    yield segments
    segments.close()


def path(name: str) -> str:
    return os.path.join(shm.SHM_DIR, name)


def exclusive(name: str) -> bool:
    """Whether nobody holds the file open or mapped (what a claimant checks on its descriptor)."""
    fd = os.open(name, os.O_RDONLY)
    try:
        return shm._alone(fd)
    finally:
        os.close(fd)


@pytest.fixture(params=["write", "mapped"])
def writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a segment is written: ``write()`` (small ones) and through a mapping of its own
    (from ``MAPPED_WRITE_BYTES`` on)."""
    if request.param == "mapped":
        monkeypatch.setattr(shm, "MAPPED_WRITE_BYTES", 0)
    return str(request.param)


def test_write_segment_lays_buffers_out_aligned(unit: shm.UnitSegments, writes: str) -> None:
    """Each buffer lands at a 64-byte aligned offset and reads back byte for byte, from read-only
    bytes and from a tensor's memory alike."""
    tensor = torch.arange(1000, dtype=torch.int64)
    bufs = [bytes(range(10)), b"", bytes(100), memoryview(tensor.numpy()).cast("B")]
    name = shm.chunk_segment(unit.token, 1)
    regions = shm.write_segment(name, bufs)
    assert [r.offset % 64 for r in regions] == [0, 0, 0, 0]
    assert [r.nbytes for r in regions] == [10, 0, 100, 8000]
    with open(path(name), "rb") as f:
        data = f.read()
    for buf, r in zip(bufs, regions, strict=True):
        assert data[r.offset : r.offset + r.nbytes] == bytes(buf)
    assert exclusive(path(name))  # no mapping of the writer's is left: it can be a spare
    shm.unlink(name)


def test_writer_writes_into_a_claimed_spare(unit: shm.UnitSegments, writes: str) -> None:
    """A claimed spare (larger than needed, holding old bytes) is renamed to the segment's name and
    gets the new bytes at the new regions; its size is kept."""
    spare = f"tqs-{unit.token}-p1"
    with open(path(spare), "wb") as f:
        f.write(b"\xff" * 6000)
    name = shm.chunk_segment(unit.token, 3)
    bufs = [bytes(range(200)), b"\x01" * 3000]
    writer = shm.Writer()
    regions, reused, _ = writer.write(name, bufs, [Spare(spare, 6000, inode(spare))])
    writer.close()
    assert reused == spare and not os.path.exists(path(spare))
    with open(path(name), "rb") as f:
        data = f.read()
    assert len(data) == 6000
    for buf, r in zip(bufs, regions, strict=True):
        assert data[r.offset : r.offset + r.nbytes] == buf
    assert exclusive(path(name))
    shm.unlink(name)


def inode(name: str) -> int:
    return os.stat(path(name)).st_ino


def recycle(name: str, spare: str) -> Spare:
    """What the unit does with a dropped chunk's segment: a spare, listed with its inode."""
    os.rename(path(name), path(spare))
    return Spare(spare, os.stat(path(spare)).st_size, inode(spare))


def test_writer_keeps_the_mapping_of_a_large_segment_and_writes_it_again(
    unit: shm.UnitSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment written through a mapping keeps it: offered back as a spare, the next write goes
    into that mapping (no new one) and lands in the same pages."""
    monkeypatch.setattr(shm, "MAPPED_WRITE_BYTES", 0)
    writer = shm.Writer()
    first = shm.chunk_segment(unit.token, 1)
    _, reused, kept = writer.write(first, [bytes(range(256)) * 64], [])
    assert reused == "" and kept == inode(first) and writer.kept_bytes >= 16384
    assert not exclusive(path(first))  # the writer's descriptor holds it
    spare = recycle(first, f"tqs-{unit.token}-p1")
    second = shm.chunk_segment(unit.token, 2)
    _, reused, again = writer.write(second, [b"\x07" * 10000], [spare])
    assert (reused, again) == (spare.name, kept) and len(writer._kept) == 1
    with open(path(second), "rb") as f:
        assert f.read(10000) == b"\x07" * 10000
    writer.close()
    assert exclusive(path(second))  # closed: nothing of the writer's holds it
    shm.unlink(second)


def test_writer_never_writes_a_spare_somebody_maps(
    unit: shm.UnitSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare a reader still maps (its views alive), or that another writer keeps, is not claimed
    (the put gets a new segment) and the reader's bytes stay as they were."""
    monkeypatch.setattr(shm, "MAPPED_WRITE_BYTES", 0)
    writer, other = shm.Writer(), shm.Writer()
    first = shm.chunk_segment(unit.token, 1)
    _, _, kept = writer.write(first, [b"\x01" * 8192], [])
    fd = os.open(path(first), os.O_RDONLY)
    reader = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    spare = recycle(first, f"tqs-{unit.token}-p1")
    second = shm.chunk_segment(unit.token, 2)
    _, reused, new = writer.write(second, [b"\x02" * 8192], [spare])
    assert reused == "" and new not in (0, kept) and os.path.exists(path(spare.name))
    assert reader[:8192] == b"\x01" * 8192
    reader.close()  # the reader is gone: the writer may have it, not another writer
    _, reused, _ = other.write(shm.chunk_segment(unit.token, 3), [b"\x03" * 8192], [spare])
    assert reused == ""
    _, reused, again = writer.write(shm.chunk_segment(unit.token, 4), [b"\x04" * 8192], [spare])
    assert (reused, again) == (spare.name, kept)
    writer.close()
    other.close()
    shm.remove_segments(unit.token)


def test_writer_lets_go_of_unlinked_segments_and_keeps_a_bounded_few(
    unit: shm.UnitSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept segment the unit unlinked (a spare evicted) is let go at the next write; at most
    ``SPARE_SEGMENTS`` are kept, the least recently written let go first."""
    monkeypatch.setattr(shm, "MAPPED_WRITE_BYTES", 0)
    monkeypatch.setattr(shm, "SPARE_SEGMENTS", 2)
    writer = shm.Writer()
    names = [shm.chunk_segment(unit.token, i) for i in range(3)]
    inodes = [writer.write(name, [bytes(4096)], [])[2] for name in names]
    assert list(writer._kept) == inodes[1:]
    shm.unlink(names[1])
    writer.write(shm.chunk_segment(unit.token, 9), [bytes(4096)], [])
    assert inodes[1] not in writer._kept and inodes[2] in writer._kept
    writer.close()
    assert writer.kept_bytes == 0
    shm.remove_segments(unit.token)


def test_write_segment_leaves_nothing_when_dev_shm_is_full(
    unit: shm.UnitSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while reserving the pages raises and removes the half-made segment."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = shm.chunk_segment(unit.token, 2)
    with pytest.raises(OSError, match="No space"):
        shm.write_segment(name, [bytes(10)])
    assert not os.path.exists(path(name))


def test_claim_takes_the_smallest_fitting_spare_once() -> None:
    """A spare of size..2*size is renamed to the segment's name; one claimant wins; too small, too
    big, foreign or vanished spares are skipped."""
    token = secrets.token_hex(8)
    names = [f"tqs-{token}-p{i}" for i in range(4)]
    for name, size in zip(names, (50, 250, 140, 400), strict=True):
        with open(path(name), "wb") as f:
            f.write(bytes(size))
    spares = [Spare(n, s, inode(n)) for n, s in zip(names, (50, 250, 140, 400), strict=True)]
    spares.append(Spare("tqs-elsewhere-p9", 100))
    writer = shm.Writer()
    try:
        assert writer.write(f"tqs-{token}-c7", [bytes(128)], list(spares))[1] == names[2]
        assert not os.path.exists(path(names[2]))  # 140: smallest in [128, 256]
        assert writer.write(f"tqs-{token}-c8", [bytes(128)], spares[2:3])[1] == ""  # claimed
        assert writer.write(f"tqs-{token}-c9", [bytes(1000)], list(spares))[1] == ""  # too big
    finally:
        writer.close()
        shm.remove_segments(token)


def test_exclusive_only_when_nobody_holds_the_file() -> None:
    """The write-lease check fails while another descriptor or a mapping holds the file."""
    name = f"tqs-{secrets.token_hex(8)}-c1"
    with open(path(name), "wb") as f:
        f.write(bytes(4096))
    try:
        assert exclusive(path(name))
        fd = os.open(path(name), os.O_RDONLY)
        m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE)
        os.close(fd)
        assert not exclusive(path(name))
        m.close()
        assert exclusive(path(name))
    finally:
        shm.unlink(name)


def test_a_chunk_is_adopted_once(unit: shm.UnitSegments) -> None:
    """A second adoption of the same chunk is refused and the first stays intact."""
    name = shm.chunk_segment(unit.token, 5)
    regions = shm.write_segment(name, [bytes(64)])
    views = unit.adopt(5, regions)
    with pytest.raises(tqstream.MalformedMessageError, match="already stored"):
        unit.adopt(5, regions)
    assert unit.region(views[0]) == Region(name, 0, 64)
    del views
    unit.release(5)
    assert [s.name for s in unit.spares()] == [f"tqs-{unit.token}-p1"]  # nobody maps it
    assert unit.spare_bytes > 0


def test_client_maps_a_vanished_segment_as_unknown_rows() -> None:
    """Rows cleared between the unit's answer and the client's mapping: UnknownRowError; a reply
    placing a frame out of range: InternalError."""
    token = secrets.token_hex(8)
    frames = [b"header", b""]
    gone = {1: Region(f"tqs-{token}-c424242", 0, 8)}
    with pytest.raises(tqstream.UnknownRowError, match="does not exist"):
        _shared_frames(token, gone, frames)
    with pytest.raises(tqstream.InternalError, match="frame 3"):
        _shared_frames(token, {3: Region(f"tqs-{token}-c1", 0, 8)}, frames)


def test_unit_without_shared_memory_refuses_a_shared_store() -> None:
    """A Store naming shared memory at a unit that has none gets InvalidRequestError."""
    ctx: zmq.Context[object] = zmq.Context()
    service = StorageService(StorageConfig(), controller=None, ctx=ctx)
    try:
        if service.segments is not None:
            service.segments.close()
        service.segments = None
        _, cols = columns_from_data({"x": torch.arange(4)})
        refs, _ = columns_to_wire(cols)
        msg = Store(rid=1, partition="p", chunk=1, row_ids=[0, 1, 2, 3], columns=refs,
                    shared=[Region("tqs-0000000000000000-c1", 0, 32)])  # fmt: skip
        with pytest.raises(tqstream.InvalidRequestError, match="no shared memory"):
            service.handle(msg, [b""], None)  # type: ignore[arg-type]
    finally:
        service.server._sock.close(linger=0)
        ctx.destroy(linger=0)


# --- receive segments ----------------------------------------------------------------------------
def test_gather_goes_into_the_smallest_fitting_receive_segment(unit: shm.UnitSegments) -> None:
    """A gather is written into the smallest offered receive segment it fits (its pages exist);
    offers too small, vanished, of another unit or not receive segments are passed over, and with
    none left the gather gets a fresh segment."""
    names = [f"tqs-{unit.token}-r{i}" for i in range(3)]
    for name, size in zip(names, (100, 8192, 4096), strict=True):
        with open(path(name), "wb") as f:
            f.write(b"\xff" * size)
    bufs = [bytes(range(200)), b"\x02" * 1000]
    offers = [Spare(n, s) for n, s in zip(names, (100, 8192, 4096), strict=True)]
    regions = unit.gather_segment(bufs, offers)
    assert {r.name for r in regions} == {names[2]}  # 4096: the smallest of at least 1,280
    with open(path(names[2]), "rb") as f:
        data = f.read()
    assert len(data) == 4096
    for buf, r in zip(bufs, regions, strict=True):
        assert data[r.offset : r.offset + r.nbytes] == buf
    foreign = [
        Spare(f"tqs-{'0' * 16}-r1", 8192),
        Spare(f"tqs-{unit.token}-c1", 8192),
        Spare(f"tqs-{unit.token}-r99", 8192),  # does not exist
        Spare(names[0], 100),
    ]
    fresh = unit.gather_segment(bufs, foreign)
    assert {r.name for r in fresh} == {f"tqs-{unit.token}-g1"}


def test_receiver_offers_only_segments_nobody_holds(unit: shm.UnitSegments) -> None:
    """A fresh gather segment becomes the client's receive segment once mapped; it is offered only
    while no view maps it and no other Fetch has it; a failed Fetch's offers are let go (the unit
    may write them still)."""
    receiver = shm.Receiver(unit.token)
    regions = unit.gather_segment([bytes(4096)])
    receiver.done([], regions)
    assert not os.path.exists(path(regions[0].name))  # renamed: the client's now
    offered = receiver.offer()
    assert len(offered) == 1 and offered[0].name.startswith(f"tqs-{unit.token}-r")
    assert receiver.offer() == []  # in flight
    views = shm.Segments(unit.token).view(unit.gather_segment([b"\x05" * 64], offered)[0])
    receiver.done(offered, [shm.Region(offered[0].name, 0, 64)])
    assert receiver.offer() == []  # a view maps it
    del views
    again = receiver.offer()
    assert again == offered
    receiver.failed(again)
    assert not os.path.exists(path(again[0].name)) and receiver.offer() == []
    receiver.close()


def test_receiver_lets_go_of_swept_segments_and_keeps_a_bounded_few(
    unit: shm.UnitSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive segment the unit swept (not written for ORPHAN_AGE) is let go at the next offer;
    at most RECEIVE_SEGMENTS are kept, the least recently used let go (unlinked) first; close
    unlinks the rest."""
    monkeypatch.setattr(shm, "RECEIVE_SEGMENTS", 2)
    receiver = shm.Receiver(unit.token)
    for _ in range(3):
        receiver.done([], unit.gather_segment([bytes(64)]))
    kept = segments_of(unit.token, "r")
    assert len(kept) == 2
    assert unit.sweep_orphans(age=-1) == 2  # every receive segment is "old" here
    assert receiver.offer() == [] and receiver._kept == {}
    receiver.done([], unit.gather_segment([bytes(64)]))
    receiver.close()
    assert segments_of(unit.token, "r") == set()


def segments_of(token: str, kind: str) -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"tqs-{token}-{kind}")}


def test_writer_keeps_nothing_it_could_not_write_or_bound(
    unit: shm.UnitSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment alone over ``SPARE_BYTES`` is written and not kept; a copy that fails leaves no
    segment and no mapping behind."""
    monkeypatch.setattr(shm, "MAPPED_WRITE_BYTES", 0)
    monkeypatch.setattr(shm, "SPARE_BYTES", 4096)
    writer = shm.Writer()
    big = shm.chunk_segment(unit.token, 1)
    writer.write(big, [b"\x09" * 8192], [])
    with open(path(big), "rb") as f:
        assert f.read() == b"\x09" * 8192
    assert writer._kept == {} and exclusive(path(big))

    def broken(*args: object) -> None:
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(shm._Kept, "copy", broken)
    failed = shm.chunk_segment(unit.token, 2)
    with pytest.raises(OSError, match="Bad address"):
        writer.write(failed, [bytes(1024)], [])
    assert not os.path.exists(path(failed)) and writer._kept == {}
    writer.close()
    shm.unlink(big)


def test_a_reader_refuses_segments_that_are_not_the_units() -> None:
    """A region naming another unit's segment, a spare or a direct put's segment is refused with
    the names a unit serves from."""
    token = secrets.token_hex(8)
    reader = shm.Segments(token)
    for name in (f"tqs-{'0' * 16}-c1", f"tqs-{token}-p1", f"tqs-{token}-d1", "../etc/passwd"):
        with pytest.raises(tqstream.MalformedMessageError, match="is not one of this storage unit"):
            reader.view(Region(name, 0, 8))
