"""Across hosts, on a rig (``tqstream.testing.rig``): three network namespaces with a /dev/shm each,
joined by a bridge whose links are shaped to 10 Gbit/s. The controller and a storage unit on host 1,
a unit on hosts 2 and 3, CURVE keys on every socket; producers on hosts 2 and 3, the consumer on
host 1. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tqstream
from tqstream import ClientConfig
from tqstream.testing.rig import Rig, RigCluster, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"needs a multi-host rig: {WHY}")


def _cluster(keys: str) -> Iterator[RigCluster]:
    with Rig(hosts=3, rate="10gbit") as rig:
        c = RigCluster(rig, keys)
        try:
            yield c
        finally:
            c.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RigCluster]:
    yield from _cluster(str(tmp_path_factory.mktemp("rig") / "cluster.keys"))


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RigCluster]:
    """A rig of its own, for a test that takes a host off the network."""
    yield from _cluster(str(tmp_path / "cluster.keys"))


def client(cluster: RigCluster, **settings: object) -> tqstream.Client:
    """A client on this machine (it reaches the hosts through the bridge)."""
    return tqstream.connect(cluster.address, ClientConfig(keys=cluster.keys, **settings))  # type: ignore[arg-type]


def test_exactly_once_across_hosts_and_each_producer_on_its_own_host(
    cluster: RigCluster, partition: str
) -> None:
    with client(cluster) as c:
        c.create_partition(partition, ["id", "x"], tasks=["t"])
    producers = [cluster.start(h, "produce", partition, h * 10_000, 200, 4, 256, "host")
                 for h in (2, 3)]  # fmt: skip
    consumed = cluster.run(1, "consume", partition, 400, 16)
    made = [p.communicate(timeout=120)[0] for p in producers]
    assert all(p.returncode == 0 for p in producers), made
    ids = consumed["ids"]
    assert sorted(ids) == [*range(20_000, 20_200), *range(30_000, 30_200)]  # each exactly once
    for host, out in zip((2, 3), made, strict=True):
        assert set(json.loads(out)["units"]) == {host - 1}  # its own host's unit
    with client(cluster) as c:
        units = c.stats().units
        assert units[1].local_bytes > 0 and units[2].local_bytes > 0
        assert units[1].remote_read_bytes > 0  # host 1's consumer read them over the network
        assert c.stats(partition).partitions[partition].rows == 0  # acked, freed
        c.clear_partition(partition)


def test_without_keys_a_client_on_another_host_is_refused(cluster: RigCluster) -> None:
    with pytest.raises(tqstream.ConnectError):
        tqstream.connect(cluster.address, ClientConfig(connect_timeout=2.0))


def test_a_host_cut_off_loses_its_unit_and_replicas_lose_nothing(
    own_cluster: RigCluster, partition: str
) -> None:
    cluster = own_cluster
    with client(cluster) as c:
        c.create_partition(partition, ["id", "x"], tasks=["t"], replicas=2)
    out = cluster.run(3, "produce", partition, 0, 120, 4, 64, "host")
    assert set(out["units"]) == {2}  # on host 3's unit, a copy elsewhere
    cluster.rig.cut(3)
    with client(cluster) as c:
        deadline = time.monotonic() + 30
        while c.stats().units[2].alive and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not c.stats().units[2].alive  # lost within 3 heartbeats
    consumed = cluster.run(1, "consume", partition, 120, 8)  # the survivors serve every row
    assert sorted(consumed["ids"]) == list(range(120))
    with client(cluster) as c:
        p = c.stats(partition).partitions[partition]
        assert p.lost == 0
        c.clear_partition(partition)


def test_the_rig_cleans_up() -> None:
    with Rig(hosts=1) as rig:
        shm = Path(rig.shm(1))
        assert shm.is_dir()
    assert not shm.exists()
