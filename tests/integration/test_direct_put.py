"""Small puts in one exchange (``PutRows`` to a storage unit, which has the controller commit them).

The contract suite already runs every small put through this path; here: that it gives exactly
what a placed put gives, that refused and malformed puts leave nothing behind, and the races of a
put whose commit is in flight at its unit. Those are forced deterministically with a scripted
controller (a real ZMQ server whose answer to ``PutStored`` the test releases) in front of a real
storage unit: a fetch of the rows, a drop order for them and a clear of their partition each reach
the unit before the controller's answer does.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import zmq

import tqstream
from tqstream import Client
from tqstream.config import StorageConfig
from tqstream.convert.inputs import columns_from_data
from tqstream.protocol import shm
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    Columns,
    DropPartition,
    DropRows,
    Fetch,
    GetUnitStats,
    MetaReply,
    Ok,
    PreparePut,
    PutRows,
    PutStored,
    Registered,
    RegisterUnit,
    StoredReply,
    StoredResults,
)
from tqstream.protocol.server import Responder, Server
from tqstream.protocol.transport import context, error_reply
from tqstream.protocol.wire import column_from_wire, columns_to_wire
from tqstream.storage.service import StorageService
from tqstream.types import BatchMeta


def trajectory(i: int, n: int = 5) -> dict[str, Any]:
    return {
        "input_ids": [torch.arange(i, i + n)],
        "versions": [torch.tensor([-1] + [i] * (n - 1), dtype=torch.int32)],
        "note": [f"row {i}"],
        "rewards": torch.tensor([float(i)]),
    }


def test_a_direct_put_equals_a_placed_put(deployment: tuple[str, str], partition: str) -> None:
    direct = tqstream.connect(deployment[1])
    placed = tqstream.connect(deployment[1], tqstream.ClientConfig(direct_put_bytes=0))
    try:
        a = direct.put(trajectory(3), partition, keys=["a"], groups=["g"], group_size=2)
        b = placed.put(trajectory(3), partition, keys=["b"], groups=["g"], group_size=2)
        assert (a.version_start, a.version_end) == (b.version_start, b.version_end) == ([3], [3])
        got = direct.get(partition, ["input_ids", "versions", "note", "rewards"], 2, "t",
                         whole_groups=True)  # fmt: skip
        assert got.meta.keys == ["a", "b"] and got.meta.groups == ["g", "g"]
        for i in range(2):
            assert torch.equal(got.data["input_ids"][i], torch.arange(3, 8))
        assert got.data.get("note").tolist() == ["row 3", "row 3"]
        assert direct.stats(partition).partitions[partition].pending_puts == 0
    finally:
        direct.close()
        placed.close()


def test_a_refused_direct_put_leaves_no_bytes(client: Client, partition: str) -> None:
    client.put(trajectory(0), partition, keys=["k"])
    base = client.stats().storage_bytes
    with pytest.raises(tqstream.DuplicateKeyError):
        client.put(trajectory(1), partition, keys=["k"])
    bad = trajectory(1)
    bad["rewards"] = torch.tensor([1], dtype=torch.int64)
    with pytest.raises(tqstream.SchemaError, match="'rewards'"):
        client.put(bad, partition)
    client.close_partition(partition)
    with pytest.raises(tqstream.PartitionClosedError):
        client.put(trajectory(2), partition)
    st = client.stats()
    assert st.storage_bytes == base and st.partitions[partition].rows == 1


def test_concurrent_direct_puts_with_acks_that_free_rows_lose_nothing(
    deployment: tuple[str, str], partition: str
) -> None:
    """Producers put one row at a time while a registered task reads and acks as fast as it can:
    acks order drops that race the puts' landings; every row is read once and nothing stays."""
    address = deployment[1]
    with tqstream.connect(address) as c:
        c.create_partition(partition, ["input_ids", "rewards"], tasks=["t"], producers=4)
        base = c.stats().storage_bytes

        def produce(p: int) -> None:
            with tqstream.connect(address) as mine:
                for i in range(100):
                    mine.put(trajectory(p * 1000 + i), partition)
                mine.close_partition(partition)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
        for t in threads:
            t.start()
        seen: list[float] = []
        while True:
            try:
                batch = c.get(partition, ["input_ids", "rewards"], 16, "t", auto_ack=True,
                              timeout=30)  # fmt: skip
            except tqstream.PartitionDrainedError:
                break
            seen += batch.data["rewards"].tolist()
        for t in threads:
            t.join()
        assert sorted(seen) == sorted(float(p * 1000 + i) for p in range(4) for i in range(100))
        assert c.stats().storage_bytes == base


# --- a storage unit in front of a scripted controller ----------------------------------------
class ScriptedController:
    """Registers the unit and holds every ``PutStored`` until the test answers it."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.server = Server(ctx, "127.0.0.1", 0, self.handle, name="controller",
                             max_message_bytes=1 << 20)  # fmt: skip
        self.held: asyncio.Queue[tuple[PutStored, Responder]] = asyncio.Queue()

    def handle(self, msg: Any, frames: list[Any], responder: Responder) -> Any:
        if isinstance(msg, RegisterUnit):
            return Registered(rid=msg.rid, unit=0)
        assert isinstance(msg, PutStored)
        self.held.put_nowait((msg, responder))
        return None  # answered by the test


@asynccontextmanager
async def unit_with_scripted_controller() -> AsyncIterator[tuple[ScriptedController, Connection]]:
    ctx = context()
    ctrl = ScriptedController(ctx)
    serving = [asyncio.ensure_future(ctrl.server.serve())]
    unit = StorageService(StorageConfig(), ctrl.server.address, ctx)
    serving.append(asyncio.ensure_future(unit.serve()))
    await unit.register()
    conn = await Connection.open(ctx, unit.address, connect_timeout=5.0, heartbeat_interval=1.0,
                                 max_message_bytes=1 << 20)  # fmt: skip
    try:
        yield ctrl, conn
    finally:
        conn.close()
        await unit.close()
        await ctrl.server.close()
        for s in serving:
            s.cancel()
        ctx.destroy(linger=0)


def put_rows(partition: str, i: int, token: str = "") -> tuple[PutRows, list[Any]]:
    """A PutRows of one row; with ``token``, its bytes in a direct segment of that unit."""
    n, cols = columns_from_data({"x": torch.tensor([[float(i), 1.0]])})
    put = PreparePut(rid=0, partition=partition, n_rows=n, nbytes=0,
                     schemas={k: c.schema for k, c in cols.items()})  # fmt: skip
    if token:
        refs, buffers = columns_to_wire(cols)
        regions = shm.write_segment(shm.direct_segment(token), buffers)
        return PutRows(rid=0, put=put, columns=refs, shared=regions), []
    refs, frames = columns_to_wire(cols, packed=True)
    return PutRows(rid=0, put=put, columns=refs), frames


def names(token: str, kind: str) -> set[str]:
    """The unit's segments of one kind ("c" chunks, "d" direct puts, "l" taken, "p" spares)."""
    prefix = f"tqs-{token}-{kind}"
    return {
        n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix) and n[len(prefix) :].isdigit()
    }


PATHS = pytest.mark.parametrize(
    "shared",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(not shm.available(), reason="no /dev/shm")),
    ],
    ids=["frames", "shared-memory"],
)


def answer(chunk: int, partition: str, rows: list[int]) -> StoredResults:
    """The controller's answer to a PutStored of one put: committed as ``rows`` in ``chunk``."""
    return StoredResults(
        rid=0, results=[StoredReply(rid=0, chunk=chunk, meta=committed(partition, rows))]
    )


def committed(partition: str, rows: list[int]) -> BatchMeta:
    n = len(rows)
    return BatchMeta(partition, rows, [f"k{r}" for r in rows], [0] * n, [None] * n,
                     [None] * n, [None] * n, ["x"], {})  # fmt: skip


def test_a_fetch_that_overtakes_the_landing_waits_for_it() -> None:
    async def main() -> None:
        async with unit_with_scripted_controller() as (ctrl, conn):
            msg, frames = put_rows("p", 7)
            putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
            stored, responder = await asyncio.wait_for(ctrl.held.get(), 10)
            assert stored.unit == 0 and stored.puts[0].nbytes == 8  # the unit counts the bytes
            fetch = Fetch(rid=0, partition="p", row_ids=[40], fields=["x"])
            fetching = asyncio.ensure_future(conn.request(fetch, timeout=10))
            await asyncio.sleep(0.2)
            assert not fetching.done()  # row 40 is not held yet, but a put is landing
            responder.reply(answer(9, "p", [40]))
            reply, _ = await putting
            assert isinstance(reply, MetaReply) and reply.meta.row_ids == [40]
            got, got_frames = await fetching
            assert isinstance(got, Columns)
            x = column_from_wire(got.columns[0], got_frames)
            assert x.values.tolist() == [[7.0, 1.0]]
            # with nothing landing, an unknown row fails at once
            with pytest.raises(tqstream.UnknownRowError):
                await conn.request(Fetch(rid=0, partition="p", row_ids=[41], fields=["x"]),
                                   timeout=10)  # fmt: skip

    asyncio.run(main())


@PATHS
def test_a_drop_that_overtakes_the_landing_is_applied_when_it_lands(shared: bool) -> None:
    """... and through shared memory the dropped put's segment is recycled, the kept one's is
    named after its chunk: no segment is left in between."""

    async def main() -> None:
        async with unit_with_scripted_controller() as (ctrl, conn):
            token = conn.welcome.shm if shared else ""
            for i, (rows, chunk) in enumerate((([50], 3), ([51], 4))):
                msg, frames = put_rows("p", i, token)
                putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
                _, responder = await asyncio.wait_for(ctrl.held.get(), 10)
                if i == 0:  # the drop of row 50 comes first: kept for the landing
                    drop = DropRows(rid=0, partition="p", row_ids=[50, 999])
                    assert isinstance((await conn.request(drop, timeout=10))[0], Ok)
                else:  # a clear of the partition's chunks before 5 comes first
                    clear = DropPartition(rid=0, partition="p", before_chunk=5)
                    assert isinstance((await conn.request(clear, timeout=10))[0], Ok)
                responder.reply(answer(chunk, "p", rows))
                await putting
                with pytest.raises(tqstream.UnknownRowError):
                    await conn.request(Fetch(rid=0, partition="p", row_ids=rows, fields=["x"]),
                                       timeout=10)  # fmt: skip
            # a later put of a re-created partition (chunk 6 >= 5) is kept
            msg, frames = put_rows("p", 2, token)
            putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
            _, responder = await asyncio.wait_for(ctrl.held.get(), 10)
            responder.reply(answer(6, "p", [52]))
            await putting
            got, _ = await conn.request(Fetch(rid=0, partition="p", row_ids=[52], fields=["x"]),
                                        timeout=10)  # fmt: skip
            assert isinstance(got, Columns)
            if token:
                assert names(token, "c") == {shm.chunk_segment(token, 6)}
                assert names(token, "d") == names(token, "l") == set()

    asyncio.run(main())


@PATHS
def test_a_put_the_controller_refuses_is_not_kept(shared: bool) -> None:
    async def main() -> None:
        async with unit_with_scripted_controller() as (ctrl, conn):
            token = conn.welcome.shm if shared else ""
            msg, frames = put_rows("p", 1, token)
            putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
            _, responder = await asyncio.wait_for(ctrl.held.get(), 10)
            refused = tqstream.DuplicateKeyError("key 'a' exists", keys=["a"])
            responder.reply(StoredResults(rid=0, results=[error_reply(refused, "")]))
            with pytest.raises(tqstream.DuplicateKeyError, match="key 'a' exists"):
                await putting
            # the whole message failing fails its puts alike
            msg, frames = put_rows("p", 1, token)
            putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
            _, responder = await asyncio.wait_for(ctrl.held.get(), 10)
            responder.fail(tqstream.CapacityError("no room", nbytes=8))
            with pytest.raises(tqstream.CapacityError, match="no room"):
                await putting
            stats, _ = await conn.request(GetUnitStats(rid=0), timeout=10)
            assert stats.stats.bytes == 0 and stats.stats.chunks == 0
            if token:  # both segments became spares
                assert names(token, "c") == names(token, "d") == names(token, "l") == set()
                assert len(names(token, "p")) == 2

    asyncio.run(main())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("schemas", "the put's schemas {x: dense int64[2]} do not match its columns "
                    "{x: dense float32[2]}"),
        ("rows", "column 'x': has 1 rows, expected 2"),
    ],
)  # fmt: skip
def test_malformed_put_rows_are_refused_by_the_unit(
    deployment: tuple[str, str], change: str, message: str
) -> None:
    async def main() -> None:
        ctx = context()
        with tqstream.connect(deployment[1]) as c:
            address = c.stats().units[0].address
        conn = await Connection.open(ctx, address, connect_timeout=5.0, heartbeat_interval=1.0,
                                     max_message_bytes=1 << 20)  # fmt: skip
        try:
            msg, frames = put_rows("malformed", 0)
            put = msg.put
            if change == "schemas":
                schema = tqstream.FieldSchema("dense", "int64", (2,))
                put = PreparePut(rid=0, partition=put.partition, n_rows=1, nbytes=0,
                                 schemas={"x": schema})  # fmt: skip
            else:
                put = PreparePut(rid=0, partition=put.partition, n_rows=2, nbytes=0,
                                 schemas=put.schemas)  # fmt: skip
            with pytest.raises(tqstream.MalformedMessageError) as err:
                await conn.request(PutRows(rid=0, put=put, columns=msg.columns), frames,
                                   timeout=10)  # fmt: skip
            assert message in str(err.value)
        finally:
            conn.close()
            ctx.destroy(linger=0)
        with tqstream.connect(deployment[1]) as c:
            assert "malformed" not in c.stats().partitions

    asyncio.run(main())


def test_a_fetch_of_gone_rows_is_not_held_up_by_a_put_waiting_for_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tqstream.storage.service.LANDING_WAIT", 0.3)

    async def main() -> None:
        async with unit_with_scripted_controller() as (ctrl, conn):
            msg, frames = put_rows("p", 1)
            putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
            _, responder = await asyncio.wait_for(ctrl.held.get(), 10)  # never answered here
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(tqstream.UnknownRowError, match="row ids 77"):
                await conn.request(Fetch(rid=0, partition="p", row_ids=[77], fields=["x"]),
                                   timeout=10)  # fmt: skip
            assert 0.25 < asyncio.get_running_loop().time() - t0 < 5
            responder.reply(answer(1, "p", [1]))
            await putting

    asyncio.run(main())


def test_a_controller_answer_of_the_wrong_size_fails_the_put() -> None:
    async def main() -> None:
        async with unit_with_scripted_controller() as (ctrl, conn):
            msg, frames = put_rows("p", 1)
            putting = asyncio.ensure_future(conn.request(msg, frames, timeout=10))
            _, responder = await asyncio.wait_for(ctrl.held.get(), 10)
            responder.reply(StoredResults(rid=0, results=[]))
            with pytest.raises(tqstream.InternalError, match="expected 1 StoredResults, got"):
                await putting

    asyncio.run(main())


def test_a_unit_without_a_controller_refuses_direct_puts() -> None:
    async def main() -> None:
        ctx = context()
        unit = StorageService(StorageConfig(), None, ctx)
        serving = asyncio.ensure_future(unit.serve())
        conn = await Connection.open(ctx, unit.address, connect_timeout=5.0,
                                     heartbeat_interval=1.0, max_message_bytes=1 << 20)  # fmt: skip
        try:
            msg, frames = put_rows("p", 1)
            with pytest.raises(tqstream.InvalidRequestError) as err:
                await conn.request(msg, frames, timeout=10)
            assert str(err.value) == (
                "this storage unit is not registered with a controller, so it cannot take puts "
                "directly; start it with a controller address"
            )
        finally:
            conn.close()
            await unit.close()
            serving.cancel()
            ctx.destroy(linger=0)

    asyncio.run(main())
