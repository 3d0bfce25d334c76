"""Write identity, with real processes: a row is (row id, generation), the generation being its
partition's incarnation. Row ids are never reused under a name within one cluster, but a restore
reuses the saved ones, so after a clear and a restore the same row id names another sample; the
storage unit refuses a read (or a write) of a generation other than the one its rows were written
with, so metadata of an earlier incarnation never gets the bytes of another sample."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq.asyncio

import tqstream
from tqstream.convert.inputs import columns_from_data
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import Columns, Fetch, Ok, Store
from tqstream.protocol.wire import column_from_wire, columns_to_wire

FAST = tqstream.ClientConfig(connect_timeout=3.0, reconnect_timeout=30.0)
RAW_CHUNK = 1 << 40  # chunk ids far above any the controller assigns in these tests


def _rows(first: int, n: int = 4) -> dict[str, torch.Tensor]:
    """``n`` rows whose values say which sample they are: row i holds first + i, three times."""
    return {"x": torch.arange(first, first + n, dtype=torch.int64)[:, None].repeat(1, 3)}


def _saved(path: Path, first: int) -> tqstream.BatchMeta:
    """A checkpoint at ``path`` of another cluster, whose partition "p" holds the samples
    ``first ..``: the same row ids as a first put of "p" in any cluster, other bytes."""
    with tqstream.init(storage_units=1) as other:
        meta = other.put(_rows(first), "p")
        other.save_checkpoint(path)
    return meta


@pytest.fixture
def cluster() -> Any:
    with ProcessCluster(1) as c, tqstream.connect(c.address, FAST) as client:
        yield client


def test_a_row_id_reused_after_a_clear_never_returns_the_old_bytes(
    cluster: tqstream.Client, tmp_path: Path
) -> None:
    c = cluster
    theirs = _saved(tmp_path / "theirs", 1000)
    mine = c.put(_rows(0), "p")
    assert torch.equal(c.get_data(mine)["x"], _rows(0)["x"])
    assert c.clear_partition("p")
    c.load_checkpoint(tmp_path / "theirs")  # the ids of the cleared rows name other samples now
    now = c.lookup("p", row_ids=mine.row_ids, fields=["x"])
    assert now.row_ids == mine.row_ids == theirs.row_ids and now.units == mine.units
    assert now.generation > mine.generation  # a new incarnation, whatever the saved one was
    assert torch.equal(c.get_data(now)["x"], _rows(1000)["x"])
    with pytest.raises(tqstream.StaleRowError, match="earlier incarnation of the partition") as e:
        c.get_data(mine)
    assert isinstance(e.value, tqstream.UnknownRowError)  # what callers of a cleared read catch
    details = e.value.details
    assert (details["generation"], details["held"]) == (mine.generation, now.generation)
    assert details["partition"] == "p" and details["rows"] == mine.row_ids


def test_a_row_id_reused_after_a_restore_never_returns_the_old_bytes(
    cluster: tqstream.Client, tmp_path: Path
) -> None:
    c = cluster
    _saved(tmp_path / "theirs", 1000)
    put = c.put(_rows(0), "p")
    c.save_checkpoint(tmp_path / "mine")
    c.clear_partition("p")
    c.load_checkpoint(tmp_path / "mine")
    restored = c.get("p", "x", 4, "t", timeout=10)
    assert restored.meta.row_ids == put.row_ids
    assert torch.equal(restored.data["x"], _rows(0)["x"])
    with pytest.raises(tqstream.StaleRowError):  # the same samples, but restored since
        c.get_data(put)
    restored.ack()
    c.clear_partition("p")
    c.load_checkpoint(tmp_path / "theirs")  # the restored rows' ids, other samples
    with pytest.raises(tqstream.StaleRowError, match="cleared or restored since"):
        c.get_data(restored.meta)
    again = c.get("p", "x", 4, "t", timeout=10)
    assert again.meta.row_ids == restored.meta.row_ids
    assert torch.equal(again.data["x"], _rows(1000)["x"])


def test_metadata_outlives_a_controller_restart_but_not_a_clear(tmp_path: Path) -> None:
    """A restarted controller replays its journal into the same incarnations: metadata issued
    before the restart still reads its rows; once the partition is cleared and put to again, it
    is refused (the new rows have other ids, and the old ones are gone)."""
    with (
        ProcessCluster(1, durability="batched", journal=str(tmp_path / "journal")) as cluster,
        tqstream.connect(cluster.address, FAST) as c,
    ):
        before = c.put(_rows(0), "p")
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        cluster.restart_controller()
        assert torch.equal(c.get_data(before)["x"], _rows(0)["x"])
        assert c.lookup("p", row_ids=before.row_ids).generation == before.generation
        c.clear_partition("p")
        after = c.put(_rows(10), "p")
        assert after.generation > before.generation
        with pytest.raises(tqstream.StaleRowError):
            c.get_data(before)
        assert torch.equal(c.get_data(after)["x"], _rows(10)["x"])


def _store(partition: str, chunk: int, generation: int, first: int) -> tuple[Store, list[Any]]:
    _, columns = columns_from_data(_rows(first))
    refs, buffers = columns_to_wire(columns)
    msg = Store(rid=0, partition=partition, chunk=chunk, row_ids=[0, 1, 2, 3], columns=refs,
                generation=generation)  # fmt: skip
    return msg, buffers


def _fetch(partition: str, generation: int) -> Fetch:
    return Fetch(rid=0, partition=partition, row_ids=[0, 1, 2, 3], fields=["x"],
                 generation=generation)  # fmt: skip


def test_a_storage_unit_refuses_a_read_or_a_write_of_another_generation(
    cluster: tqstream.Client,
) -> None:
    """Raw Store and Fetch messages to a storage unit process: a read is served the rows of its
    generation only, a write of an older generation is refused, a newer one replaces the rows."""
    address = cluster.stats().units[0].address

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        conn = await Connection.open(
            ctx, address, connect_timeout=5.0, heartbeat_interval=1.0, max_message_bytes=1 << 30
        )
        try:

            async def read(generation: int) -> torch.Tensor:
                reply, frames = await conn.request(_fetch("raw", generation), timeout=5)
                assert isinstance(reply, Columns)
                return column_from_wire(reply.columns[0], frames).values

            reply, _ = await conn.request(*_store("raw", RAW_CHUNK, 5, 0), timeout=5)
            assert isinstance(reply, Ok)
            assert torch.equal(await read(5), _rows(0)["x"])
            with pytest.raises(tqstream.StaleRowError, match=r"names generation 4, but this"):
                await read(4)
            with pytest.raises(tqstream.UnknownRowError) as e:  # generation 6 is not here yet
                await read(6)
            assert not isinstance(e.value, tqstream.StaleRowError)
            with pytest.raises(tqstream.StaleRowError, match="nothing was stored: put the data"):
                await conn.request(*_store("raw", RAW_CHUNK + 1, 4, 500), timeout=5)
            assert torch.equal(await read(5), _rows(0)["x"])  # the refused write changed nothing
            # a newer generation's first write replaces the older one's rows (a clear's drop
            # order may still be on its way): the same row ids, other bytes
            reply, _ = await conn.request(*_store("raw", RAW_CHUNK + 2, 6, 100), timeout=5)
            assert isinstance(reply, Ok)
            assert torch.equal(await read(6), _rows(100)["x"])
            with pytest.raises(tqstream.StaleRowError):
                await read(5)
        finally:
            conn.close()
            ctx.destroy(linger=0)

    asyncio.run(main())
