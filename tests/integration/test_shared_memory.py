"""Shared memory between a client and a storage unit on the same host: tensor bytes go through
``/dev/shm`` segments instead of ZMQ frames, got tensors are copy-on-write views of them, and
every segment is unlinked when its rows are dropped, when a Store is refused, at unit close, or by
the next unit after its owner died."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import msgspec
import pytest
import torch
import zmq

import tqstream
from tqstream import Client
from tqstream.convert.inputs import columns_from_data
from tqstream.protocol import shm
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    DropChunks,
    Fetch,
    GetUnitStats,
    Ok,
    PreparePut,
    PutRows,
    Region,
    Store,
    UnitStatsReply,
)
from tqstream.protocol.wire import columns_to_wire

pytestmark = pytest.mark.skipif(
    not shm.available(), reason=f"needs a writable POSIX shared-memory directory ({shm.SHM_DIR})"
)

T = TypeVar("T")
EVERY_SIZE = tqstream.ClientConfig(shared_memory_min_bytes=0)
"""Shared memory for chunks of any size (by default small chunks go as frames)."""
GATHER_ROWS = 3 * shm.GATHER_SEGMENT_BYTES // (2 * 1024 * 4)
"""Rows of float32[1024] that make 1.5 times the size from which gathered rows use a segment."""
RAW_CHUNK = 1 << 40  # chunk ids far above any the controller assigns in these tests


# --- helpers -------------------------------------------------------------------------------------
def segments(token: str, kind: str = "") -> set[str]:
    """Names under /dev/shm of ``token``'s segments (``kind``: "c", "g", "p" (spares), "probe"
    or all)."""
    prefix = f"tqs-{token}-{kind}"
    return {
        name
        for name in os.listdir(shm.SHM_DIR)
        if name.startswith(prefix) and (kind != "p" or name[len(prefix) :].isdigit())
    }


def maps() -> list[tuple[int, int, str, str]]:
    """(start, end, perms, path) of every mapping of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            start, end = (int(a, 16) for a in parts[0].split("-"))
            out.append((start, end, parts[1], parts[5] if len(parts) > 5 else ""))
    return out


def mapping_of(t: torch.Tensor) -> tuple[str, str]:
    """(perms, path) of the mapping that holds ``t``'s bytes, ("", "") when none does."""
    first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size() - 1
    for start, end, perms, path in maps():
        if start <= first < end:
            return (perms, path) if last < end else ("", "")
    return "", ""


def mapped(name: str) -> list[str]:
    """Paths of this process's mappings of segment ``name`` (deleted or not)."""
    path = f"{shm.SHM_DIR}/{name}"
    return [p for _, _, _, p in maps() if p == path or p == f"{path} (deleted)"]


def in_chunk_segment(t: torch.Tensor, token: str) -> bool:
    """Whether ``t`` is a private (copy-on-write) view of one of ``token``'s chunk segments."""
    perms, path = mapping_of(t)
    return perms.endswith("p") and path.startswith(f"{shm.SHM_DIR}/tqs-{token}-c")


def core_of(client: Client) -> Any:
    """The core this thread's sync calls run on (the thread's lane when the client has lanes,
    else its IO thread's)."""
    lanes = client._lanes
    lane = lanes._lanes.get(threading.current_thread()) if lanes is not None else None
    return client._core if lane is None else lane.core


def shm_tokens(client: Client) -> dict[int, str]:
    """unit -> token, of the units this thread's sync calls reach through shared memory."""
    return core_of(client)._shm  # type: ignore[no-any-return]


def token_of(client: Client, unit: int = 0) -> str:
    """The shared-memory token a unit offers in its Welcome (whatever the client uses)."""
    address = client.stats().units[unit].address
    return on_unit(address, _welcome_token)


async def _welcome_token(conn: Connection) -> str:
    return conn.welcome.shm


def on_unit(address: str, body: Callable[[Connection], Awaitable[T]]) -> T:
    """Run ``body`` with a raw protocol connection to the storage unit at ``address``."""

    async def main() -> T:
        ctx = zmq.Context[Any]()
        try:
            conn = await Connection.open(
                ctx, address, connect_timeout=5.0, heartbeat_interval=1.0, max_message_bytes=1 << 30
            )
            try:
                return await body(conn)
            finally:
                conn.close()
        finally:
            ctx.destroy(linger=0)

    return asyncio.run(main())


def store_request(token: str, chunk: int, data: dict[str, Any]) -> tuple[Store, list[Region]]:
    """A Store of ``data`` as chunk ``chunk`` with its bytes written to the chunk's segment."""
    n, columns = columns_from_data(data)
    refs, buffers = columns_to_wire(columns)
    regions = shm.write_segment(shm.chunk_segment(token, chunk), buffers)
    msg = Store(rid=0, partition="raw", chunk=chunk, row_ids=list(range(n)), columns=refs)
    return msgspec.structs.replace(msg, shared=regions), regions


async def unit_chunks(conn: Connection) -> int:
    reply, _ = await conn.request(GetUnitStats(rid=0), timeout=5)
    assert isinstance(reply, UnitStatsReply)
    return reply.stats.chunks


def rows(n: int) -> dict[str, Any]:
    """One field of every kind: dense int64/bool/float32/int32 [n, 8], a scalar, ragged, str."""
    base = torch.arange(n * 8).reshape(n, 8)
    return {
        "ids": base,
        "mask": base % 3 == 0,
        "logp": base.to(torch.float32) / 7,
        "pos": (base * 2).to(torch.int32),
        "reward": torch.arange(n, dtype=torch.float32) - 0.5,
        "tokens": [torch.arange(i, 2 * i + 1) for i in range(n)],
        "prompt": [f"prompt {i} " * (i % 4) for i in range(n)],
    }


def assert_rows(data: Any, expected: dict[str, Any]) -> None:
    for name in ("ids", "mask", "logp", "pos", "reward"):
        got = data[name]
        assert got.dtype == expected[name].dtype and torch.equal(got, expected[name]), name
    for i, row in enumerate(expected["tokens"]):
        assert torch.equal(data["tokens"][i], row)
    assert data.get("prompt").tolist() == expected["prompt"]


@contextlib.contextmanager
def same_host(
    storage_units: int = 1, config: tqstream.ClientConfig | None = None
) -> Iterator[tuple[Client, Client]]:
    """(owner, client): an embedded cluster and a client connected to it over TCP — another
    connection on the same host, which shares the units' memory (the owner itself reaches its
    servers in-process, over inproc, where bytes go as frames)."""
    owner = tqstream.init(storage_units=storage_units)
    try:
        client = tqstream.connect(owner.address, config or EVERY_SIZE)
        try:
            yield owner, client
        finally:
            client.close()
    finally:
        owner.close()


@pytest.fixture
def embedded() -> Iterator[Client]:
    """A same-host client of a one-unit embedded cluster, shared memory on (the default)."""
    with same_host() as (_, client):
        yield client


@pytest.fixture(params=["write", "mapped"])
def writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Segments written with ``write()`` (small ones) or through a mapping of the writer's own
    (``MAPPED_WRITE_BYTES`` and larger): both carry the data alike."""
    if request.param == "mapped":
        monkeypatch.setattr(shm, "MAPPED_WRITE_BYTES", 0)
    return str(request.param)


# --- data paths ----------------------------------------------------------------------------------
def test_put_and_get_go_through_shared_memory(embedded: Client, writes: str) -> None:
    """Every field kind round-trips; the put wrote a chunk segment and the got dense tensors are
    copy-on-write views of it (zero copy on the way out)."""
    data = rows(12)
    embedded.put(data, "p")
    token = shm_tokens(embedded)[0]
    assert segments(token, "c"), "the put wrote no chunk segment"
    batch = embedded.get("p", list(data), batch_size=12, task="t", timeout=5)
    assert_rows(batch.data, data)
    for name in ("ids", "mask", "logp", "pos", "reward"):
        assert in_chunk_segment(batch.data[name], token), (name, mapping_of(batch.data[name]))
    assert in_chunk_segment(batch.data["tokens"].values(), token)


def test_put_fields_go_through_shared_memory(embedded: Client) -> None:
    """Fields added to existing rows are stored in their own chunk segment and read back."""
    meta = embedded.put({"x": torch.arange(6)}, "p")
    token = shm_tokens(embedded)[0]
    before = segments(token, "c")
    embedded.put_fields(meta, {"y": torch.arange(6, 12, dtype=torch.float32)})
    assert len(segments(token, "c") - before) == 1
    batch = embedded.get("p", ["x", "y"], batch_size=6, task="t", timeout=5)
    assert batch.data["y"].tolist() == list(range(6, 12))
    assert in_chunk_segment(batch.data["y"], token)


def test_in_process_client_shares_memory_too() -> None:
    """The embedded cluster's own client (inproc) puts large chunks through a segment as well and
    gets views of it; small chunks go as frames."""
    client = tqstream.init()
    try:
        token = token_of(client)
        small = rows(12)
        client.put(small, "p")
        assert segments(token, "c") == set()
        assert_rows(client.get("p", list(small), batch_size=12, task="t", timeout=5).data, small)
        big = torch.randn(512, 1024)
        client.put({"x": big}, "q")
        assert len(segments(token, "c")) == 1
        got = client.get("q", "x", batch_size=512, task="t", timeout=5).data["x"]
        assert torch.equal(got, big) and in_chunk_segment(got, token)
    finally:
        client.close()


def test_shared_memory_off_uses_frames_only() -> None:
    """With shared_memory="off" the same data round-trips and no chunk segment is created."""
    with same_host(config=tqstream.ClientConfig(shared_memory="off")) as (_, client):
        token = token_of(client)
        assert token and segments(token, "probe"), "the unit offers shared memory"
        data = rows(12)
        client.put(data, "p")
        assert segments(token, "c") == set()
        batch = client.get("p", list(data), batch_size=12, task="t", timeout=5)
        assert_rows(batch.data, data)
        assert not shm_tokens(client)
        assert "tqs-" not in mapping_of(batch.data["ids"])[1]
        assert segments(token, "c") == segments(token, "g") == set()


def test_view_outlives_cleared_rows_and_is_reclaimed(embedded: Client) -> None:
    """A got tensor stays readable after its rows are cleared (the chunk's name is gone: the
    segment is now a spare, or unlinked; its pages stay); once the tensor is garbage this process
    maps it no more."""
    x = torch.arange(4096, dtype=torch.float64).reshape(64, 64)
    embedded.put({"x": x}, "p")
    token = shm_tokens(embedded)[0]
    batch = embedded.get("p", "x", batch_size=64, task="t", timeout=5)
    got = batch.data["x"]
    path = mapping_of(got)[1]
    assert path.startswith(f"{shm.SHM_DIR}/tqs-{token}-c"), path
    name = os.path.basename(path)
    embedded.clear_partition("p")
    assert name not in os.listdir(shm.SHM_DIR)
    assert torch.equal(got, x)
    spare = os.path.basename(mapping_of(got)[1].removesuffix(" (deleted)"))
    assert spare == name or spare.startswith(f"tqs-{token}-p"), spare
    del batch, got
    gc.collect()
    assert mapped(name) == mapped(spare) == []


def test_writing_a_got_tensor_does_not_change_stored_rows(embedded: Client) -> None:
    """Got tensors are copy-on-write: writing one in place leaves what other tasks get intact."""
    x = torch.arange(32, dtype=torch.int64).reshape(4, 8)
    meta = embedded.put({"x": x}, "p")
    token = shm_tokens(embedded)[0]
    mine = embedded.get("p", "x", batch_size=4, task="a", timeout=5).data["x"]
    assert in_chunk_segment(mine, token)
    mine.fill_(-1)
    assert bool((mine == -1).all())
    assert torch.equal(embedded.get("p", "x", batch_size=4, task="b", timeout=5).data["x"], x)
    assert torch.equal(embedded.get_by_keys("p", meta.keys, ["x"]).data["x"], x)


def test_large_gathers_go_into_the_clients_receive_segments(embedded: Client, writes: str) -> None:
    """Rows spanning two chunks (>= 1 MiB gathered) come back right through a segment the client
    then keeps as its receive segment (no gather segment is left): a later gather is written into
    those pages once the views of the earlier one are gone, never while they are held (another
    segment takes it); the client's close unlinks them."""

    def gather() -> torch.Tensor:
        a, b = torch.randn(GATHER_ROWS, 1024), torch.randn(GATHER_ROWS, 1024)
        embedded.put({"x": a}, "p")
        embedded.put({"x": b}, "p")
        got = embedded.get("p", "x", batch_size=2 * GATHER_ROWS, task="t", timeout=5).data["x"]
        assert torch.equal(got, torch.cat([a, b]))
        return got

    first = gather()
    token = shm_tokens(embedded)[0]
    assert segments(token, "g") == set()
    assert mapped_path(first).startswith(f"{shm.SHM_DIR}/tqs-{token}-r")
    held = first.clone()
    second = gather()  # the first's views are alive: not written, another segment is
    inodes = {os.stat(mapped_path(t)).st_ino for t in (first, second)}
    assert len(inodes) == 2 and torch.equal(first, held)
    del first, second
    gc.collect()
    for _ in range(3):  # the pages of the first two are written again
        got = gather()
        assert os.stat(mapped_path(got)).st_ino in inodes
        del got
        gc.collect()
    assert len(segments(token, "r")) == 2 and segments(token, "g") == set()
    core_of(embedded).close()
    assert segments(token, "r") == set()


def test_small_gather_goes_as_frames(embedded: Client) -> None:
    """Rows out of order and under 1 MiB come back right without any gather segment."""
    x = torch.arange(64, dtype=torch.int32).reshape(16, 4)
    assert x.nbytes < shm.GATHER_SEGMENT_BYTES
    meta = embedded.put({"x": x, "s": [str(i) for i in range(16)]}, "p")
    token = shm_tokens(embedded)[0]
    order = [15, 3, 7, 0, 9]
    got = embedded.get_by_keys("p", [meta.keys[i] for i in order], ["x", "s"]).data
    assert torch.equal(got["x"], x[order])
    assert got.get("s").tolist() == [str(i) for i in order]
    assert segments(token, "g") == set()
    assert "tqs-" not in mapping_of(got["x"])[1]


def test_two_units_each_share_their_own_segments() -> None:
    """With two units each has its own token and segments; a get spanning both is right."""
    with same_host(storage_units=2) as (_, client):
        parts = [torch.arange(12) + 12 * i for i in range(3)]
        units = {u for x in parts for u in client.put({"x": x}, "p").units}
        assert units == {0, 1}
        tokens = shm_tokens(client)
        assert set(tokens) == {0, 1} and tokens[0] != tokens[1]
        assert all(segments(token, "c") for token in tokens.values())
        got = client.get("p", "x", batch_size=36, task="t", timeout=5).data["x"]
        assert torch.equal(got, torch.cat(parts))
    assert all(segments(token) == set() for token in tokens.values())


def test_chunk_segment_is_unlinked_with_its_last_row(embedded: Client) -> None:
    """Clearing some rows of a chunk keeps its segment; clearing the last one unlinks it."""
    meta = embedded.put({"x": torch.arange(4)}, "p")
    token = shm_tokens(embedded)[0]
    (name,) = segments(token, "c")
    embedded.clear_samples(meta.select([0, 1]))
    assert segments(token, "c") == {name}
    assert embedded.get_by_keys("p", meta.keys[2:], ["x"]).data["x"].tolist() == [2, 3]
    embedded.clear_samples(meta.select([2, 3]))
    assert segments(token, "c") == set()


def test_unit_without_a_visible_probe_gets_frames(embedded: Client) -> None:
    """A unit whose probe this client cannot read (another host) is served through frames."""
    token = token_of(embedded)
    shm.unlink(f"tqs-{token}-probe")
    data = rows(6)
    embedded.put(data, "p")
    assert not shm_tokens(embedded)
    assert segments(token) == set()
    assert_rows(embedded.get("p", list(data), batch_size=6, task="t", timeout=5).data, data)


def test_clients_with_and_without_shared_memory_share_rows(embedded: Client) -> None:
    """Rows put through frames are read through shared memory and the other way round; a large
    read of a chunk stored as frames comes through a segment of the reader's (no gather segment
    is left)."""
    framed = tqstream.connect(embedded.address, tqstream.ClientConfig(shared_memory="off"))

    try:
        big = torch.randn(GATHER_ROWS, 1024)
        framed.put({"x": big}, "a")
        got = embedded.get("a", "x", batch_size=GATHER_ROWS, task="t", timeout=5).data["x"]
        assert torch.equal(got, big)
        token = shm_tokens(embedded)[0]
        assert segments(token, "g") == set()
        assert mapping_of(got)[1].startswith(f"{shm.SHM_DIR}/tqs-{token}-r")
        data = rows(5)
        embedded.put(data, "b")
        assert segments(token, "c")
        assert_rows(framed.get("b", list(data), batch_size=5, task="t", timeout=5).data, data)
    finally:
        framed.close()


def test_process_cluster_uses_shared_memory_and_cleans_up() -> None:
    """With storage in another process, the got tensors still map the unit's chunk segment, and
    stopping the cluster leaves none of the unit's names behind."""
    with tqstream.ProcessCluster(storage_units=1) as cluster:
        client = tqstream.connect(cluster.address, EVERY_SIZE)
        try:
            data = rows(10)
            client.put(data, "p")
            token = shm_tokens(client)[0]
            assert segments(token, "c") and segments(token, "probe")
            batch = client.get("p", list(data), batch_size=10, task="t", timeout=10)
            assert_rows(batch.data, data)
            assert in_chunk_segment(batch.data["logp"], token)
        finally:
            client.close()
    assert segments(token) == set()
    assert torch.equal(batch.data["ids"], data["ids"])  # the view outlives the unit


def test_close_removes_every_segment_of_the_unit() -> None:
    """Closing an embedded cluster stops its unit, which unlinks its probe and live chunks."""
    with same_host() as (owner, client):
        client.put({"x": torch.arange(100)}, "p")
        token = shm_tokens(client)[0]
        assert segments(token, "c") and segments(token, "probe")
        client.close()
        owner.close()
        assert segments(token) == set()


def test_full_dev_shm_put_falls_back_to_frames(
    embedded: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose segment cannot be written (/dev/shm full) is sent as frames instead."""

    def full(self: shm.Writer, name: str, buffers: Any, spares: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", name)

    monkeypatch.setattr(shm.Writer, "write", full)
    data = rows(8)
    embedded.put(data, "p")
    token = shm_tokens(embedded)[0]
    assert segments(token, "c") == set()
    assert_rows(embedded.get("p", list(data), batch_size=8, task="t", timeout=5).data, data)


def test_full_dev_shm_large_gather_falls_back_to_frames(
    embedded: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gathered get of >= 1 MiB still succeeds when /dev/shm has no room for the gather segment:
    its bytes go as frames."""
    a, b = torch.randn(GATHER_ROWS, 1024), torch.randn(GATHER_ROWS, 1024)
    embedded.put({"x": a}, "p")
    embedded.put({"x": b}, "p")

    def full(name: str, buffers: Any, reuse: bool = False) -> list[Region]:
        raise OSError(errno.ENOSPC, "No space left on device", name)

    monkeypatch.setattr(shm, "write_segment", full)
    got = embedded.get("p", "x", batch_size=2 * GATHER_ROWS, task="t", timeout=5).data["x"]
    assert torch.equal(got, torch.cat([a, b]))


def test_direct_put_hands_its_segment_to_the_unit_and_reuses_spares(
    embedded: Client, writes: str
) -> None:
    """A put small enough for one exchange (PutRows) writes its own segment, which the unit takes
    and names after the chunk; the rows' clear recycles it as a spare, which a later put claims;
    no direct or landing segment is ever left behind."""
    x = torch.randn(128, 1024)
    assert x.nbytes < embedded._core.config.direct_put_bytes
    embedded.put({"x": x}, "p")
    token = shm_tokens(embedded)[0]
    assert len(segments(token, "c")) == 1
    got = embedded.get("p", "x", batch_size=128, task="t", timeout=5).data["x"]
    assert torch.equal(got, x) and in_chunk_segment(got, token)
    del got
    gc.collect()
    embedded.clear_partition("p")
    spares = segments(token, "p")
    assert spares and segments(token, "c") == set()
    embedded.put({"x": x + 1}, "q")  # its answer lists the spares (the client's last news)
    assert segments(token, "p") == spares
    embedded.put({"x": x + 2}, "r")  # claims one (renamed to its segment: its pages exist)
    assert len(segments(token, "p")) == len(spares) - 1
    got = embedded.get("r", "x", batch_size=128, task="t", timeout=5).data["x"]
    assert torch.equal(got, x + 2)
    assert segments(token, "d") == segments(token, "l") == set()


def test_refused_direct_put_leaves_no_segment(embedded: Client, writes: str) -> None:
    """A direct put the controller refuses (a schema change) raises the typed error; its segment
    goes back to the unit's spares and nothing is stored; the writer keeps no mapping of it."""
    embedded.put({"x": torch.randn(64, 256)}, "p")
    token = shm_tokens(embedded)[0]
    chunks = segments(token, "c")
    writer = core_of(embedded)._writer
    kept = set(writer._kept)
    with pytest.raises(tqstream.SchemaError, match="stored as dense float32"):
        embedded.put({"x": torch.randn(64, 512)}, "p")
    assert segments(token, "c") == chunks
    assert segments(token, "d") == segments(token, "l") == set()
    assert embedded.stats("p").partitions["p"].rows == 64
    assert set(writer._kept) == kept  # the refused put's segment: never written again


def test_large_puts_write_into_the_mappings_the_writer_kept() -> None:
    """A put of a large segment (``MAPPED_WRITE_BYTES`` and more) keeps its mapping: once the rows
    are acked and nobody maps the segment any more, the next put writes into the same pages; a
    consumer still holding views keeps its data (the next put takes another segment); the
    client's close lets every mapping go."""
    size = shm.MAPPED_WRITE_BYTES // 4  # float32 elements: one segment of MAPPED_WRITE_BYTES
    with same_host() as (_, client):
        inodes = []
        for i in range(4):
            x = torch.full((16, size // 16), float(i))
            client.put({"x": x}, "p")
            token = shm_tokens(client)[0]
            inodes += list(_inodes(token, "c"))
            batch = client.get("p", "x", batch_size=16, task="t", timeout=5)
            assert torch.equal(batch.data["x"], x)
            del batch
            gc.collect()
            client.clear_partition("p")
        # the client learns of a spare in the next put's answer: two segments take turns
        assert inodes[2:] == inodes[:2] and inodes[0] != inodes[1], inodes
        writer = core_of(client)._writer
        assert set(writer._kept) == set(inodes)

        def round_trip(value: float, keep: bool = False) -> torch.Tensor | None:
            client.put({"x": torch.full((16, size // 16), value)}, "p")
            got = client.get("p", "x", batch_size=16, task="t", timeout=5).data["x"]
            assert bool((got == value).all())
            client.clear_partition("p")
            return got if keep else None

        held = round_trip(0.0, keep=True)  # its segment, now a spare, is still mapped by `held`
        round_trip(1.0)  # (its answer lists that spare)
        client.put({"x": torch.full((16, size // 16), 2.0)}, "p")
        assert not set(_inodes(token, "c")) & set(inodes)  # a new segment, not held's
        assert held is not None and bool((held == 0).all())
        assert len(writer._kept) == 3
        del held
        gc.collect()
        client.clear_partition("p")
        names = segments(token, "p")
        client.close()
        assert writer.kept_bytes == 0
        assert all(mapped(name) == [] for name in names)


# --- refused and aborted stores at the protocol level -----------------------------------------
def test_store_arriving_after_its_chunk_was_dropped_is_refused(embedded: Client) -> None:
    """A Store whose chunk was rolled back while it was in flight (segment written, then the drop,
    then the Store) is refused as rolled back, like one sent as frames; the drop unlinked the
    segment and nothing is stored."""
    address = embedded.stats().units[0].address

    async def body(conn: Connection) -> None:
        token = conn.welcome.shm
        chunk = RAW_CHUNK + 1
        msg, _ = store_request(token, chunk, {"v": torch.arange(8)})
        await conn.request(DropChunks(rid=0, chunks=[chunk]), timeout=5)
        assert segments(token, "c") == set()
        with pytest.raises(tqstream.InvalidRequestError, match="rolled back"):
            await conn.request(msg, timeout=5)
        assert await unit_chunks(conn) == 0
        assert segments(token, "c") == set()

    on_unit(address, body)


def test_segment_written_after_its_chunk_was_dropped_is_unlinked(embedded: Client) -> None:
    """A segment written after its chunk was dropped is unlinked when its refused Store arrives,
    and nothing is stored."""
    address = embedded.stats().units[0].address

    async def body(conn: Connection) -> None:
        token = conn.welcome.shm
        chunk = RAW_CHUNK + 2
        await conn.request(DropChunks(rid=0, chunks=[chunk]), timeout=5)
        msg, _ = store_request(token, chunk, {"v": torch.arange(8)})
        assert segments(token, "c") == {shm.chunk_segment(token, chunk)}
        with pytest.raises(tqstream.InvalidRequestError, match="rolled back"):
            await conn.request(msg, timeout=5)
        assert await unit_chunks(conn) == 0
        assert segments(token, "c") == set()

    on_unit(address, body)


def test_segment_whose_store_never_arrives_is_unlinked_by_the_drop(embedded: Client) -> None:
    """The segment of an aborted put whose Store never reached the unit is unlinked by the drop
    that rolls the put back (its name follows from the chunk id)."""
    address = embedded.stats().units[0].address

    async def body(conn: Connection) -> None:
        token = conn.welcome.shm
        chunk = RAW_CHUNK + 3
        store_request(token, chunk, {"v": torch.arange(8)})
        assert segments(token, "c") == {shm.chunk_segment(token, chunk)}
        await conn.request(DropChunks(rid=0, chunks=[chunk]), timeout=5)
        assert segments(token, "c") == set()
        assert await unit_chunks(conn) == 0

    on_unit(address, body)


def test_direct_put_whose_segment_is_gone_is_refused(embedded: Client) -> None:
    """A PutRows whose segment its client removed (it gave up on the put) is refused with a
    message saying so; one naming anything but a direct segment of this unit is malformed; the
    unit stores nothing either way and keeps serving."""
    address = embedded.stats().units[0].address
    n, columns = columns_from_data({"v": torch.arange(8)})

    async def body(conn: Connection) -> None:
        token = conn.welcome.shm
        refs, buffers = columns_to_wire(columns)
        schemas = {name: col.schema for name, col in columns.items()}
        req = PreparePut(rid=0, partition="raw", n_rows=n, schemas=schemas, nbytes=64)
        name = shm.direct_segment(token)
        regions = shm.write_segment(name, buffers)
        shm.unlink(name)  # the client gave up
        msg = PutRows(rid=0, put=req, columns=refs, shared=regions)
        with pytest.raises(tqstream.InvalidRequestError, match="does not exist: its client gave"):
            await conn.request(msg, timeout=5)
        for bad in ([Region(f"tqs-{token}-c1", 0, 64)], [Region("../x", 0, 64)]):
            with pytest.raises(tqstream.MalformedMessageError, match="a direct put names one"):
                await conn.request(msgspec.structs.replace(msg, shared=bad), timeout=5)
        assert await unit_chunks(conn) == 0
        assert segments(token, "d") == segments(token, "l") == set()

    on_unit(address, body)


def test_direct_segment_of_a_client_that_never_sent_it_is_swept() -> None:
    """A direct put's segment that no PutRows came for (its client died in between) is unlinked
    by the unit's sweep once old enough, and only then; other names are left alone."""
    unit = shm.UnitSegments()
    try:
        name = shm.direct_segment(unit.token)
        shm.write_segment(name, [b"x" * 100])
        assert unit.sweep_orphans(age=3600.0) == 0
        assert segments(unit.token, "d") == {name}
        assert unit.sweep_orphans(age=-1.0) == 1
        assert segments(unit.token, "d") == set()
        assert segments(unit.token, "probe")
    finally:
        unit.close()


def test_store_naming_a_foreign_segment_is_refused(embedded: Client) -> None:
    """A Store may only name its own chunk's segment of this unit: another unit's segment or a
    path is refused as malformed, nothing is stored and the foreign segment is left alone."""
    address = embedded.stats().units[0].address
    other = secrets.token_hex(8)

    async def body(conn: Connection) -> None:
        token = conn.welcome.shm
        chunk = RAW_CHUNK + 10
        _, foreign = store_request(other, chunk, {"v": torch.arange(8)})
        try:
            for bad in (foreign, [Region("../x", 0, 64)], [Region(f"tqs-{token}-c1", 0, 64)]):
                msg = Store(
                    rid=0,
                    partition="raw",
                    chunk=chunk,
                    row_ids=list(range(8)),
                    columns=columns_to_wire(columns_from_data({"v": torch.arange(8)})[1])[0],
                    shared=bad,
                )
                with pytest.raises(tqstream.MalformedMessageError, match="must name segment"):
                    await conn.request(msg, timeout=5)
            assert await unit_chunks(conn) == 0
            assert segments(other, "c") == {shm.chunk_segment(other, chunk)}
        finally:
            shm.unlink(shm.chunk_segment(other, chunk))
        assert segments(token, "c") == set()

    on_unit(address, body)


def test_store_with_a_region_out_of_bounds_is_refused_and_unlinked(embedded: Client) -> None:
    """A region beyond its segment's end is refused as malformed, nothing is stored and the
    segment's name is unlinked; the unit keeps serving."""
    address = embedded.stats().units[0].address

    async def body(conn: Connection) -> None:
        token = conn.welcome.shm
        chunk = RAW_CHUNK + 20
        msg, regions = store_request(token, chunk, {"v": torch.arange(8)})
        size = os.path.getsize(f"{shm.SHM_DIR}/{regions[0].name}")
        bad = [Region(regions[0].name, regions[0].offset, size + 1)]
        with pytest.raises(tqstream.MalformedMessageError, match="outside segment"):
            await conn.request(msgspec.structs.replace(msg, shared=bad), timeout=5)
        assert shm.chunk_segment(token, chunk) not in os.listdir(shm.SHM_DIR)
        assert await unit_chunks(conn) == 0
        ok, _ = store_request(token, chunk + 1, {"v": torch.arange(8)})
        assert isinstance((await conn.request(ok, timeout=5))[0], Ok)
        assert await unit_chunks(conn) == 1
        await conn.request(DropChunks(rid=0, chunks=[chunk + 1]), timeout=5)
        assert segments(token, "c") == set()

    on_unit(address, body)


def test_refused_store_keeps_no_mapping_in_the_unit(embedded: Client) -> None:
    """A Store refused for a region out of bounds leaves the unit holding no mapping of the
    segment, so its pages are freed (the embedded unit runs in this process)."""
    address = embedded.stats().units[0].address
    chunk = RAW_CHUNK + 30

    async def body(conn: Connection) -> str:
        msg, regions = store_request(conn.welcome.shm, chunk, {"v": torch.arange(1024)})
        bad = [Region(regions[0].name, 0, 1 << 30)]
        with pytest.raises(tqstream.MalformedMessageError, match="outside segment"):
            await conn.request(msgspec.structs.replace(msg, shared=bad), timeout=5)
        return regions[0].name

    name = on_unit(address, body)
    gc.collect()
    assert mapped(name) == []


def test_fetch_of_shared_rows_answers_regions(embedded: Client) -> None:
    """A shared Fetch of rows in order in one chunk is answered with regions of the chunk's
    segment and empty frames; the same Fetch without ``shared`` carries the bytes."""
    x = torch.arange(40, dtype=torch.int64).reshape(10, 4)
    meta = embedded.put({"x": x}, "p")
    token = shm_tokens(embedded)[0]
    address = embedded.stats().units[0].address

    async def body(conn: Connection) -> None:
        fetch = Fetch(rid=0, partition="p", row_ids=meta.row_ids[2:6], fields=["x"], shared=True,
                      generation=meta.generation)  # fmt: skip
        reply, frames = await conn.request(fetch, timeout=5)
        (region,) = reply.shared.values()
        assert region.name.startswith(f"tqs-{token}-c") and region.nbytes == 4 * 4 * 8
        assert all(len(f.buffer) == 0 for f in frames[1:])
        with open(f"{shm.SHM_DIR}/{region.name}", "rb") as f:
            f.seek(region.offset)
            got = torch.frombuffer(bytearray(f.read(region.nbytes)), dtype=torch.int64)
        assert torch.equal(got.reshape(4, 4), x[2:6])
        plain, frames = await conn.request(msgspec.structs.replace(fetch, shared=False), timeout=5)
        assert not plain.shared and sum(len(f.buffer) for f in frames[1:]) == 4 * 4 * 8

    on_unit(address, body)


# --- segments of dead units ----------------------------------------------------------------------
def test_segments_of_a_killed_unit_are_removed_when_the_cluster_closes() -> None:
    """A storage process SIGKILLed with live chunks cannot unlink its segments; closing the
    cluster that launched it removes them, and tensors got from them stay valid."""
    with (
        tqstream.ProcessCluster(storage_units=1) as cluster,
        tqstream.connect(cluster.address, EVERY_SIZE) as client,
    ):
        data = {"x": torch.arange(1 << 16).reshape(4, -1)}
        client.put(data, "p")
        token = shm_tokens(client)[0]
        got = client.get("p", ["x"], batch_size=4, task="t", timeout=10).data["x"]
        assert in_chunk_segment(got, token)
        os.kill(cluster.procs[1].pid, signal.SIGKILL)
        cluster.procs[1].wait()
        assert segments(token, "probe") and segments(token, "c")
    assert segments(token) == set()
    assert torch.equal(got, data["x"])


def test_segments_of_a_killed_unit_are_swept_by_the_next_unit() -> None:
    """A storage process killed with live chunks leaves its segments while its launcher lives;
    the next unit started on the host removes them."""
    with (
        tqstream.ProcessCluster(storage_units=1) as cluster,
        tqstream.connect(cluster.address, EVERY_SIZE) as client,
    ):
        client.put({"x": torch.arange(1000)}, "p")
        token = shm_tokens(client)[0]
        os.kill(cluster.procs[1].pid, signal.SIGKILL)
        cluster.procs[1].wait()
        assert segments(token, "probe") and segments(token, "c")
        tqstream.init().close()
        assert segments(token) == set()


def test_new_unit_sweeps_segments_of_dead_units() -> None:
    """A unit starting on the host removes the segments of a unit whose process is gone, and
    leaves those of a live one alone, and those of units in another PID namespace or kernel (a
    container sharing /dev/shm), whose pids mean nothing here, or with a probe it cannot read."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone, alive, elsewhere, old = (secrets.token_hex(8) for _ in range(4))
    here = shm.process_key()
    files = {
        f"tqs-{gone}-probe": f"{gone} {dead.pid} {here}",
        f"tqs-{gone}-c1": "x",
        f"tqs-{alive}-probe": f"{alive} {os.getpid()} {here}",
        f"tqs-{alive}-c1": "x",
        f"tqs-{elsewhere}-probe": f"{elsewhere} {dead.pid} another-boot:4026531836",
        f"tqs-{elsewhere}-c1": "x",
        f"tqs-{old}-probe": f"{old} {dead.pid}",
        f"tqs-{old}-c1": "x",
    }
    try:
        for name, text in files.items():
            with open(f"{shm.SHM_DIR}/{name}", "x") as f:
                f.write(text)
        client = tqstream.init()
        client.close()
        assert segments(gone) == set()
        for token in (alive, elsewhere, old):
            assert segments(token) == {f"tqs-{token}-probe", f"tqs-{token}-c1"}
    finally:
        for name in files:
            shm.unlink(name)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_put_and_get_never_alias_the_callers_memory(mode: str) -> None:
    """Embedded (inproc, where ZMQ passes buffers by pointer) with and without shared memory: the
    stored rows are a copy of the producer's tensor, and a consumer's tensor is not the unit's
    memory: changing either afterwards changes nothing anyone else reads."""
    config = tqstream.ClientConfig(shared_memory=mode)
    client = tqstream.init(client_config=config)
    try:
        data = torch.arange(64 * 8192, dtype=torch.float32).reshape(64, 8192)  # 2 MiB
        expected = data.clone()
        client.put({"x": data}, "p")
        data.fill_(-1.0)  # the producer reuses its buffer
        first = client.get("p", ["x"], batch_size=64, task="a", timeout=10)
        assert torch.equal(first.data["x"], expected)
        first.data["x"].fill_(-2.0)  # the consumer writes into what it got
        second = client.get("p", ["x"], batch_size=64, task="b", timeout=10)
        assert torch.equal(second.data["x"], expected)
    finally:
        client.close()


def test_chunks_below_the_threshold_go_as_frames() -> None:
    """With the default shared_memory_min_bytes a small chunk is put as frames and a chunk at the
    threshold through a segment; both read back right."""
    small, big = torch.arange(1000), torch.randn(tqstream.ClientConfig.shared_memory_min_bytes // 4)
    with same_host(config=tqstream.ClientConfig()) as (_, client):
        token = token_of(client)
        client.put({"x": small}, "a")
        assert segments(token, "c") == set()
        client.put({"y": big.reshape(-1, 1024)}, "b")
        assert len(segments(token, "c")) == 1
        assert torch.equal(
            client.get("a", "x", batch_size=1000, task="t", timeout=5).data["x"], small
        )
        got = client.get("b", "y", batch_size=big.numel() // 1024, task="t", timeout=5).data["y"]
        assert torch.equal(got.reshape(-1), big)


def _inodes(token: str, kind: str) -> dict[int, str]:
    return {os.stat(f"{shm.SHM_DIR}/{n}").st_ino: n for n in segments(token, kind)}


def test_dropped_segment_is_reused_only_when_nobody_maps_it(writes: str) -> None:
    """A dropped chunk's segment becomes a spare; a put writes into it only once no reader maps it
    any more: a consumer still holding views keeps its data, whatever is put next."""
    first, second, third = (torch.full((256, 1024), float(i)) for i in range(3))
    with same_host() as (_, client):
        client.put({"x": first}, "p")
        token = shm_tokens(client)[0]
        held = client.get("p", "x", batch_size=256, task="t", timeout=5).data["x"]
        held_inode = os.stat(mapped_path(held)).st_ino
        client.clear_partition("p")
        assert segments(token, "c") == set() and len(segments(token, "p")) == 1
        assert client.stats().units[0].spare_bytes >= first.numel() * 4
        client.put({"x": second}, "q")  # its answer lists the spare `held` still maps ...
        client.put({"x": third}, "r")  # ... which this put finds held: it takes a new segment
        assert held_inode not in _inodes(token, "c")
        got = client.get("r", "x", batch_size=256, task="t", timeout=5).data["x"]
        assert torch.equal(held, first) and torch.equal(got, third)
        client.clear_partition("q")
        client.clear_partition("r")
        del held, got
        gc.collect()
        client.clear_partition("p")
        spares = _inodes(token, "p")
        client.put({"x": first}, "q")  # a Store reply lists the spares nobody maps any more
        client.put({"x": third}, "q")  # ... and this put claims one of them
        assert set(_inodes(token, "c")) & set(spares)
        got = client.get("q", "x", batch_size=512, task="t", timeout=5).data["x"]
        assert torch.equal(got, torch.cat([first, third]))


def mapped_path(t: torch.Tensor) -> str:
    """The file behind the mapping holding ``t``, without a " (deleted)" suffix."""
    return mapping_of(t)[1].removesuffix(" (deleted)")


def test_copy_returns_private_tensors_and_frees_the_segment(embedded: Client) -> None:
    """get(copy=True) hands out tensors in memory of their own: no mapping of the chunk segment is
    kept, so clearing the rows leaves a spare nobody maps."""
    x = torch.randn(256, 1024)
    embedded.put({"x": x}, "p")
    token = shm_tokens(embedded)[0]
    got = embedded.get("p", "x", batch_size=256, task="t", timeout=5, copy=True).data["x"]
    assert torch.equal(got, x) and "tqs-" not in mapping_of(got)[1]
    embedded.clear_partition("p")
    assert all(mapped(name) == [] for name in segments(token, "p"))


def test_a_restarted_unit_gets_new_receive_segments() -> None:
    """A unit restarted under a new token: the client moves bytes as frames until it learnt the
    new token (never naming the old one's segments), lets go of the old unit's receive segments
    (swept with it) and gathers from the new one through segments of its own."""
    with tqstream.ProcessCluster(storage_units=1) as cluster:
        client = tqstream.connect(cluster.address, EVERY_SIZE)
        try:
            client.create_partition("scratch", ["x"])
            for round_ in range(2):
                client.create_partition(f"p{round_}", ["x"], tasks=["t"])
                parts = [torch.full((GATHER_ROWS, 1024), float(i)) for i in range(2)]
                for part in parts:
                    client.put({"x": part}, f"p{round_}")
                got = client.get(f"p{round_}", "x", batch_size=2 * GATHER_ROWS, task="t",
                                 timeout=10).data["x"]  # fmt: skip
                assert torch.equal(got, torch.cat(parts))
                receiver = core_of(client)._receivers[0]
                assert receiver._kept and mapped_path(got).startswith(
                    f"{shm.SHM_DIR}/tqs-{receiver.token}-r"
                )
                del got
                if round_ == 0:
                    old = receiver
                    cluster.restart_unit(0)
                    # the first request after the reconnect asks the unit's new Welcome; one in
                    # flight across the restart fails as lost (retry), never naming old segments
                    deadline = time.monotonic() + 10
                    while shm_tokens(client).get(0) in (None, old.token):
                        assert time.monotonic() < deadline, "the new token was never learnt"
                        with contextlib.suppress(tqstream.UnitLostError):
                            client.put({"x": torch.zeros(1, 1024)}, "scratch")
                        time.sleep(0.05)
            assert receiver.token != old.token and old._kept == {}
        finally:
            client.close()
