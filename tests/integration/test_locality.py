"""Locality through the public API: a ProcessCluster with one storage unit on this host and one
started in a mount namespace of its own (a private ``/dev/shm``: for the clients here, a unit on
another host, reached over TCP only)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
import torch

import tqstream
from tqstream import ClientConfig
from tqstream.protocol import shm

ELSEWHERE = [
    "unshare", "-m", "--propagation", "private", "sh", "-c",
    'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh",
]  # fmt: skip


def _namespaces() -> str:
    """Why a private /dev/shm cannot be made here ("" when it can)."""
    try:
        done = subprocess.run([*ELSEWHERE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare cannot run: {exc}"
    return "" if done.returncode == 0 else f"unshare -m + mount refused: {done.stderr.strip()}"


WHY = _namespaces()
pytestmark = [
    pytest.mark.skipif(bool(WHY), reason=f"needs a mount namespace for a private /dev/shm: {WHY}"),
    pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tqstream.ProcessCluster]:
    with tqstream.ProcessCluster(storage_units=1, storage_max_bytes=1 << 20) as c:
        c.add_unit(ELSEWHERE)  # unit 1: another host, as far as shared memory goes
        yield c


def rows(n: int, width: int = 16) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(n * width, dtype=torch.float32).reshape(n, width)}


def test_the_client_knows_which_units_share_its_host(cluster: tqstream.ProcessCluster) -> None:
    with tqstream.connect(cluster.address) as client:
        assert client._core.near == {0}
    with tqstream.connect(cluster.address, config=ClientConfig(locality="off")) as client:
        assert client._core.near == set()


@pytest.mark.parametrize("direct", [True, False], ids=["one-exchange", "placed"])
def test_puts_land_on_this_hosts_unit(
    cluster: tqstream.ProcessCluster, partition: str, direct: bool
) -> None:
    config = ClientConfig(direct_put_bytes=16 << 20 if direct else 0)
    with tqstream.connect(cluster.address, config=config) as client:
        client.create_partition(partition, ["x"], tasks=["t"])
        before = client.stats().units
        units = [u for _ in range(12) for u in client.put(rows(2), partition).units]
        assert units == [0] * 24  # in turn, half of them would have gone to unit 1
        batch = client.get(partition, ["x"], 24, "t", timeout=10)
        assert torch.equal(batch.data["x"][:2], rows(2)["x"])
        batch.ack()
        after = client.stats().units
        assert after[0].local_bytes - before[0].local_bytes == 24 * 16 * 4
        assert after[1].local_bytes == before[1].local_bytes
        assert after[1].remote_bytes == before[1].remote_bytes
        client.clear_partition(partition)


def test_without_locality_puts_cross_to_the_other_host(
    cluster: tqstream.ProcessCluster, partition: str
) -> None:
    with tqstream.connect(cluster.address, config=ClientConfig(locality="off")) as client:
        client.create_partition(partition, ["x"], tasks=["t"])
        before = client.stats().units
        units = {u for _ in range(12) for u in client.put(rows(2), partition).units}
        assert units == {0, 1}
        client.get(partition, ["x"], 24, "t", timeout=10).ack()
        after = client.stats().units
        assert after[1].remote_bytes > before[1].remote_bytes  # it came over TCP
        client.clear_partition(partition)


def test_a_full_local_unit_sends_the_put_to_the_other_host(
    cluster: tqstream.ProcessCluster, partition: str
) -> None:
    with tqstream.connect(cluster.address) as client:
        client.create_partition(partition, ["x"], tasks=["t"])
        big = rows(1, (700 << 10) // 4)  # 700 KiB: one fits the 1 MiB quota, two do not
        first = client.put(big, partition)
        second = client.put(big, partition)  # unit 0 is full: placed on unit 1, not kept waiting
        assert (first.units, second.units) == ([0], [1])
        batch = client.get(partition, ["x"], 2, "t", timeout=10)
        assert torch.equal(batch.data["x"][1], big["x"][0])
        batch.ack()  # room again on unit 0: the next put is local again
        assert client.put(big, partition).units == [0]
        client.clear_partition(partition)


def test_two_copies_are_read_from_this_hosts_unit(
    cluster: tqstream.ProcessCluster, partition: str
) -> None:
    off, quick = ClientConfig(locality="off"), ClientConfig(request_timeout=5.0)
    with (
        tqstream.connect(cluster.address, off) as writer,
        tqstream.connect(cluster.address, quick) as reader,
    ):
        writer.create_partition(partition, ["x"], tasks=["t"], replicas=2)
        metas = [writer.put(rows(2), partition) for _ in range(4)]
        units = [u for m in metas for u in m.units]
        copies = [r for m in metas for r in m.replicas]
        assert 1 in units and all({u, r} == {0, 1} for u, r in zip(units, copies, strict=True))
        got = reader.get_meta(partition, ["x"], 8, "t", timeout=10)
        before = reader.stats().units
        data = reader.get_data(got)
        after = reader.stats().units
        assert after[1].local_read_bytes == before[1].local_read_bytes  # nothing from the other
        assert after[1].remote_read_bytes == before[1].remote_read_bytes  # host: every row read
        assert after[0].local_read_bytes - before[0].local_read_bytes == 8 * 16 * 4  # from here
        expected = torch.cat([rows(2)["x"]] * 4)
        assert torch.equal(data["x"], expected)
        reader.ack(got)
        reader.clear_partition(partition)


def test_a_unit_added_under_a_command_restarts_under_it() -> None:
    with tqstream.ProcessCluster(storage_units=1) as c:
        c.add_unit(ELSEWHERE)
        c.restart_unit(1)  # registers again at its address, with a new token, still elsewhere
        with tqstream.connect(c.address) as client:
            assert client._core.near == {0}
            assert [u.alive for u in client.stats().units] == [True, True]
