"""Dead peers and interrupted puts: real processes are killed; nothing is lost, nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from conftest import PUT_TIMEOUT

import tqstream
from tqstream.config import ControllerConfig, StorageConfig
from tqstream.convert.inputs import columns_from_data
from tqstream.launch.embedded import EmbeddedCluster
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import Ok, PreparePut, PutPlan, Store
from tqstream.protocol.wire import column_to_wire


async def _prepare_and_store_without_commit(
    address: str, unit_addresses: list[str], partition: str, stay: bool = False
) -> Any:
    """Do what a client does for a put, then stop before the commit: hang up, or (``stay``) stay
    connected without a word (the caller keeps what is returned, then destroys its context)."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    kw = dict(connect_timeout=5.0, heartbeat_interval=1.0, max_message_bytes=1 << 30)
    ctrl = await Connection.open(ctx, address, **kw)
    n, cols = columns_from_data({"x": torch.zeros(8, 1000)})
    plan, _ = await ctrl.request(
        PreparePut(
            rid=0, partition=partition, n_rows=n, schemas={"x": cols["x"].schema}, nbytes=32000
        ),
        timeout=5,
    )
    assert isinstance(plan, PutPlan)
    held = [ctx, ctrl]
    for seg in plan.segments:
        unit = await Connection.open(ctx, unit_addresses[seg.unit], **kw)
        held.append(unit)
        ref, bufs = column_to_wire("x", cols["x"].slice(seg.start, seg.stop), 1)
        reply, _ = await unit.request(
            Store(
                rid=0,
                partition=partition,
                chunk=seg.chunk,
                row_ids=list(plan.rows()[seg.start : seg.stop]),
                columns=[ref],
                generation=plan.generation,
            ),
            bufs,
            timeout=5,
        )
        assert isinstance(reply, Ok)
        if not stay:
            unit.close()
    if stay:
        return held  # the sockets stay open: libzmq's I/O thread keeps answering heartbeats
    ctrl.close()
    ctx.destroy(linger=0)
    return None


def test_uncommitted_put_of_a_connected_client_is_rolled_back_at_put_timeout(
    client: tqstream.Client, partition: str
) -> None:
    base = client.stats().storage_bytes
    units = client.stats().units
    client.put({"x": torch.zeros(1, 1000)}, partition)  # the partition exists, 1 row
    addresses = [u.address for u in units]
    held = asyncio.run(
        _prepare_and_store_without_commit(client.address, addresses, partition, stay=True)
    )
    try:
        _rolled_back_within(client, partition, base, PUT_TIMEOUT + 5)
    finally:
        held[0].destroy(linger=0)


def test_uncommitted_put_of_a_client_that_hangs_up_is_rolled_back_at_once(
    client: tqstream.Client, partition: str
) -> None:
    base = client.stats().storage_bytes
    client.put({"x": torch.zeros(1, 1000)}, partition)
    addresses = [u.address for u in client.stats().units]
    asyncio.run(_prepare_and_store_without_commit(client.address, addresses, partition))
    t0 = time.monotonic()
    _rolled_back_within(client, partition, base, 5.0, pending_seen=False)
    assert time.monotonic() - t0 < PUT_TIMEOUT  # the disconnect, not the put timeout


def _rolled_back_within(
    client: tqstream.Client, partition: str, base: int, limit: float, pending_seen: bool = True
) -> None:
    """The uncommitted put is gone within ``limit`` seconds (``pending_seen``: first check it is
    pending and invisible to readers), then clearing the partition frees every byte."""
    if pending_seen:
        st = client.stats(partition).partitions[partition]
        assert st.pending_puts == 1 and st.rows == 1  # invisible to readers
        with pytest.raises(tqstream.RequestTimeoutError, match="1 of 2 rows ready; 8 rows still"):
            client.get_meta(partition, "x", 2, "t", timeout=0)
    deadline = time.monotonic() + limit
    while (
        client.stats(partition).partitions[partition].pending_puts and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    st = client.stats(partition).partitions[partition]
    assert st.pending_puts == 0 and st.rows == 1
    client.clear_partition(partition)
    deadline = time.monotonic() + 5
    while client.stats().storage_bytes != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats().storage_bytes == base


@pytest.mark.parametrize(
    "config",
    [
        # placed: a Store of 2 MiB in a frame (its 2**19 rows travel as a run, a few bytes)
        tqstream.ClientConfig(direct_put_bytes=0, shared_memory="off"),
        tqstream.ClientConfig(shared_memory="off"),  # one PutRows of 2 MiB in a frame
    ],
    ids=["placed", "direct"],
)
def test_failed_store_leaves_no_rows_no_bytes_no_schema(config: tqstream.ClientConfig) -> None:
    # the storage unit refuses messages the controller and client would accept
    cluster = EmbeddedCluster(ControllerConfig(), StorageConfig(max_message_bytes=1 << 20))
    try:
        with tqstream.connect(cluster.address, config) as client:
            client.create_partition("p")
            with pytest.raises(tqstream.MessageTooLargeError):
                client.put({"x": torch.zeros(1 << 19)}, "p")
            st = client.stats("p")
            assert st.partitions["p"].rows == 0 and st.partitions["p"].pending_puts == 0
            assert st.partitions["p"].schemas == {}
            assert st.storage_bytes == 0
            client.put({"x": torch.zeros(4, dtype=torch.int8)}, "p")  # schema was not fixed
            assert client.stats("p").partitions["p"].rows == 4
    finally:
        cluster.close()


def test_cancelled_async_put_is_rolled_back(client: tqstream.Client, partition: str) -> None:
    base = client.stats().storage_bytes

    async def main() -> None:
        data = {"x": torch.zeros(256, 1 << 16)}  # 64 MiB: the cancel lands mid-flight
        task = asyncio.ensure_future(client.async_put(data, partition))
        await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + PUT_TIMEOUT + 5
    while time.monotonic() < deadline:
        try:
            st = client.stats(partition).partitions[partition]
        except tqstream.UnknownPartitionError:
            break  # cancelled before the prepare reached the controller
        if st.pending_puts == 0:
            assert st.rows in (0, 256)  # rolled back, or committed before the cancel landed
            if st.rows:
                client.clear_partition(partition)
            break
        time.sleep(0.05)
    else:
        raise AssertionError("cancelled put neither committed nor rolled back")
    # the Store may still be in flight when the drop order lands; it must not be kept
    while client.stats().storage_bytes != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats().storage_bytes == base


def test_consumer_killed_holding_a_lease_loses_nothing(tmp_path: object) -> None:
    with (
        ProcessCluster(1, lease_timeout=1.0) as cluster,
        tqstream.connect(cluster.address) as client,
    ):
        client.put({"x": torch.arange(4)}, "p")
        code = (
            f"import tqstream, time\nc = tqstream.connect({cluster.address!r})\n"
            f"c.get_meta('p', 'x', 4, 'actor')\nprint('leased', flush=True)\n"
            f"time.sleep(60)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "leased"  # type: ignore[union-attr]
        proc.kill()
        proc.wait()
        got = client.get("p", "x", 4, "actor", timeout=10)  # back after the lease expired
        assert sorted(got.data["x"].tolist()) == [0, 1, 2, 3]


def test_controller_death_fails_parked_get_promptly() -> None:
    cluster = ProcessCluster(1)
    try:
        client = tqstream.connect(cluster.address)
        client.create_partition("p", ["x"])
        controller = cluster.procs[0]
        t0 = time.monotonic()

        async def main() -> None:
            waiter = asyncio.ensure_future(client.async_get_meta("p", "x", 1, "t"))
            await asyncio.sleep(0.3)
            os.kill(controller.pid, signal.SIGKILL)
            with pytest.raises(tqstream.ConnectionLostError, match="get_meta"):
                await waiter

        asyncio.run(main())
        assert time.monotonic() - t0 < 10
        client.close()
    finally:
        cluster.close()


def test_storage_unit_death_fails_get_data_promptly() -> None:
    cluster = ProcessCluster(1)
    try:
        with tqstream.connect(cluster.address, tqstream.ClientConfig(connect_timeout=2.0)) as c:
            c.put({"x": torch.arange(3)}, "p")
            meta = c.get_meta("p", "x", 3, "t")
            os.kill(cluster.procs[1].pid, signal.SIGKILL)
            cluster.procs[1].wait()
            t0 = time.monotonic()
            with pytest.raises(tqstream.UnitLostError, match=r"storage unit 0 at .* 3 rows of"):
                c.get_data(meta)
            assert time.monotonic() - t0 < 10
    finally:
        cluster.close()
