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
    assert shm._exclusive(path(name))  # no mapping of the writer's is left: it can be a spare
    shm.unlink(name)


def test_write_segment_into_a_claimed_spare(unit: shm.UnitSegments, writes: str) -> None:
    """A reused spare (larger than needed, holding old bytes) gets the new bytes at the new
    regions; its size is kept."""
    name = shm.chunk_segment(unit.token, 3)
    with open(path(name), "wb") as f:
        f.write(b"\xff" * 8192)
    bufs = [bytes(range(200)), b"\x01" * 3000]
    regions = shm.write_segment(name, bufs, reuse=True)
    with open(path(name), "rb") as f:
        data = f.read()
    assert len(data) == 8192
    for buf, r in zip(bufs, regions, strict=True):
        assert data[r.offset : r.offset + r.nbytes] == buf
    assert shm._exclusive(path(name))
    shm.unlink(name)


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
    """A spare of size..2*size is renamed to the chunk's name; one claimant wins; too small, too
    big, foreign or vanished spares are skipped."""
    token = secrets.token_hex(8)
    names = [f"tqs-{token}-p{i}" for i in range(4)]
    for name, size in zip(names, (50, 150, 120, 400), strict=True):
        with open(path(name), "wb") as f:
            f.write(bytes(size))
    spares = [Spare(n, s) for n, s in zip(names, (50, 150, 120, 400), strict=True)]
    spares.append(Spare("tqs-elsewhere-p9", 100))
    target = f"tqs-{token}-c7"
    try:
        assert shm.claim(spares, target, 100) == names[2]  # 120: smallest in [100, 200]
        assert os.path.exists(path(target)) and not os.path.exists(path(names[2]))
        assert shm.claim(spares[2:3], f"tqs-{token}-c8", 100) == ""  # already claimed
        assert shm.claim(spares, f"tqs-{token}-c9", 1000) == ""  # nothing large enough
    finally:
        for name in [*names, target]:
            shm.unlink(name)


def test_exclusive_only_when_nobody_holds_the_file() -> None:
    """The write-lease check fails while another descriptor or a mapping holds the file."""
    name = f"tqs-{secrets.token_hex(8)}-c1"
    with open(path(name), "wb") as f:
        f.write(bytes(4096))
    try:
        assert shm._exclusive(path(name))
        fd = os.open(path(name), os.O_RDONLY)
        m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE)
        os.close(fd)
        assert not shm._exclusive(path(name))
        m.close()
        assert shm._exclusive(path(name))
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
