"""The Ray deployment on a real multi-node Ray cluster on this machine (``ray.cluster_utils``: a
head and two more nodes, each its own raylet): producers and consumers in actors pinned to
different nodes, a storage-unit actor killed and restarted by Ray, a controller actor with a
journal killed and restarted by Ray, nothing left after ``close()``, clients that find the
cluster by name from a Ray task."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import tqstream  # noqa: E402
import tqstream.ray  # noqa: E402
from tqstream.types import UnitStats  # noqa: E402

MB = 1 << 20
FAST = tqstream.ClientConfig(connect_timeout=3.0)


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[str]]:
    """Three Ray nodes on this machine, started once for the module; their ids, the head's (this
    driver's node) first."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "include_dashboard": False, "object_store_memory": 80 * MB},
    )
    try:
        others = [cluster.add_node(num_cpus=4, object_store_memory=80 * MB) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        # the actors and tasks below are defined here, in a module Ray's workers cannot import
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        yield [cluster.head_node.node_id] + [n.node_id for n in others]
    finally:
        ray.shutdown()
        cluster.shutdown()


def _on(node: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node, soft=False)


def _until(what: Callable[[], bool], limit: float = 10.0) -> None:
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < limit, "condition not met in time"
        time.sleep(0.05)


def _restarted(actor: Any, pid: int) -> bool:
    """Whether Ray serves ``actor`` from a new process: the unit can register with the
    controller a moment before Ray marks the actor available again."""
    try:
        return bool(ray.get(actor.pid.remote(), timeout=10) != pid)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return False


def _unit(client: tqstream.Client, address: str) -> UnitStats:
    return next(u for u in client.stats().units if u.address == address)


def _rows(first: int, n: int, width: int = 16) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(first, first + n, dtype=torch.float32)[:, None].repeat(1, width)}


# --- producers and consumers on different nodes ---
@ray.remote(num_cpus=1)
class Producer:
    """Puts ``n`` rows (``x`` = the row's number in every column) in puts of ``batch`` rows,
    then closes the partition; 8 rows x 32k float32 = 1 MiB a put, through shared memory."""

    def run(self, name: str, partition: str, first: int, n: int, batch: int) -> str:
        with tqstream.ray.connect(name=name) as client:
            for start in range(first, first + n, batch):
                keys = [f"k{i}" for i in range(start, start + batch)]
                client.put(_rows(start, batch, 32 * 1024), partition, keys=keys)
            client.close_partition(partition)
        return str(ray.get_runtime_context().get_node_id())


@ray.remote(num_cpus=1)
class Consumer:
    """Reads ``partition`` for task ``train`` until it is drained; returns (key, value) pairs."""

    def run(self, name: str, partition: str, batch: int) -> tuple[str, list[tuple[str, float]]]:
        got = []
        with tqstream.ray.connect(name=name) as client:
            while True:
                try:
                    b = client.get(partition, "x", batch, "train", timeout=60)
                except tqstream.PartitionDrainedError:
                    break
                x = b.data["x"]
                assert bool((x == x[:, :1]).all())  # every column of a row intact
                got += zip(b.meta.keys, x[:, 0].tolist(), strict=True)
                b.ack()
        return str(ray.get_runtime_context().get_node_id()), got


def test_producers_and_consumers_on_different_nodes_get_every_row_once(nodes: list[str]) -> None:
    head, a, b = nodes
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    with warnings.catch_warnings():  # one CPU each of four on every node: room left, no warning
        warnings.simplefilter("error", RuntimeWarning)
        launch = tqstream.ray.launch(name="flow", metrics_port=port)
    with launch as cluster, cluster.connect() as client:
        assert sorted(ray.get([u.node_id.remote() for u in cluster.units])) == sorted(nodes)
        assert ray.get(cluster.controller.node_id.remote()) == head
        assert len(set(cluster.unit_addresses)) == 3
        client.create_partition("flow", ["x"], tasks=["train"], producers=2)
        n = 96
        producers = [Producer.options(scheduling_strategy=_on(x)).remote() for x in (a, b)]
        consumers = [Consumer.options(scheduling_strategy=_on(x)).remote() for x in (head, b)]
        reads = [c.run.remote("flow", "flow", 8) for c in consumers]
        writes = [p.run.remote("flow", "flow", i * n, n, 8) for i, p in enumerate(producers)]
        assert ray.get(writes, timeout=180) == [a, b]
        results = ray.get(reads, timeout=180)
        assert [node for node, _ in results] == [head, b]
        pairs = [pair for _, got in results for pair in got]
        assert sorted(k for k, _ in pairs) == sorted(f"k{i}" for i in range(2 * n))  # once each
        assert all(k == f"k{int(v)}" for k, v in pairs)  # and its own data
        p = client.stats("flow").partitions["flow"]
        t = p.tasks["train"]
        # every row acked by the partition's one task, hence freed
        assert (p.produced, p.freed, p.rows, p.lost) == (2 * n, 2 * n, 0, 0)
        assert (t.available, t.leased, t.lost) == (0, 0, 0)
        _until(lambda: client.stats().storage_bytes == 0)
        for actor in producers + consumers:
            ray.kill(actor)
        # the controller actor's metrics endpoint says the same, per node's unit
        with urllib.request.urlopen(cluster.metrics_address, timeout=10) as reply:
            text = reply.read().decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        assert samples["tqstream_rows_produced_total", (("partition", "flow"),)] == 2 * n
        consumed = ("tqstream_rows_consumed_total", (("partition", "flow"), ("task", "train")))
        assert samples[consumed] == 2 * n
        up = [v for (name, _), v in samples.items() if name == "tqstream_unit_up"]
        assert up == [1.0, 1.0, 1.0]


# --- a storage-unit actor dies ---
def test_a_killed_unit_actor_is_lost_then_restarted_at_its_address(nodes: list[str]) -> None:
    _, a, b = nodes
    with (
        tqstream.ray.launch(2, name="kill", nodes=[a, b], num_cpus=0) as cluster,
        cluster.connect(FAST) as client,
    ):
        client.create_partition("one", ["x"], tasks=["t"])
        client.create_partition("two", ["x"], tasks=["t"], replicas=2)
        for i in range(8):
            client.put(_rows(4 * i, 4), "one")
            client.put(_rows(4 * i, 4), "two")
        addresses = cluster.unit_addresses
        victim, address = cluster.units[0], addresses[0]
        pid = ray.get(victim.pid.remote())
        token = ray.get(cluster.controller.unit.remote(0)).shm_token
        assert _unit(client, address).rows > 0 and glob.glob(f"/dev/shm/tqs-{token}-*")

        os.kill(pid, signal.SIGKILL)  # the unit's process, as the OOM killer would
        _until(lambda: not _unit(client, address).alive)
        _until(lambda: _unit(client, address).alive, 60.0)  # Ray restarted it, at its address
        _until(lambda: _restarted(victim, pid), 60.0)
        assert cluster.unit_addresses == addresses
        assert len(client.stats().units) == 2  # revived under its index, not a new unit
        assert not glob.glob(f"/dev/shm/tqs-{token}-*")  # what the killed process left

        one = client.stats("one").partitions["one"]
        assert one.lost > 0 and one.rows == 32 - one.lost  # counted, not hidden
        batch = client.get("two", "x", 32, "t", timeout=10)  # replicas: nothing lost
        assert sorted(batch.data["x"][:, 0].tolist()) == list(range(32))
        batch.ack()
        assert client.stats("two").partitions["two"].lost == 0

        # the same through Ray: the actor killed with restarts allowed
        other, address = cluster.units[1], addresses[1]
        pid = ray.get(other.pid.remote())
        ray.kill(other, no_restart=False)
        _until(lambda: not _unit(client, address).alive)
        _until(lambda: _unit(client, address).alive, 60.0)
        _until(lambda: _restarted(other, pid), 60.0)

        # both revived units take new rows
        def both_hold_rows() -> bool:
            client.put(_rows(0, 4), "new")
            return all(_unit(client, x).rows > 0 for x in addresses)

        _until(both_hold_rows, 20.0)


# --- the controller actor dies ---
def test_a_killed_controller_actor_with_a_journal_restarts_at_its_port(
    nodes: list[str], tmp_path: Path
) -> None:
    """Ray restarts the controller on its node: the restarted actor binds its old port and
    replays its journal, so the client carries on (the lease it held is acked, every row read
    once), and it still knows its units' ports (a unit killed afterwards comes back at its own)."""
    head, a, _ = nodes
    journal = str(tmp_path / "journal")
    config = tqstream.ClientConfig(connect_timeout=3.0, reconnect_timeout=60.0)
    with (
        tqstream.ray.launch(
            2, name="durable", nodes=[head, a], num_cpus=0, durability="batched", journal=journal
        ) as cluster,
        cluster.connect(config) as client,
    ):
        address, addresses = cluster.address, cluster.unit_addresses
        records = ray.get(cluster.controller.units.remote())
        client.create_partition("p", ["x"], tasks=["t"])
        for i in range(8):
            client.put(_rows(4 * i, 4), "p")
        held = client.get("p", "x", 8, "t", timeout=10)  # leased across the restart
        controller = cluster.controller
        pid = ray.get(controller.pid.remote())

        os.kill(pid, signal.SIGKILL)  # the controller's process, as the OOM killer would
        held.ack()  # waits for the restarted controller at the old address: the lease survived
        seen = held.data["x"][:, 0].tolist()
        while len(seen) < 32:
            batch = client.get("p", "x", 8, "t", timeout=10)
            seen += batch.data["x"][:, 0].tolist()
            batch.ack()
        assert sorted(seen) == [float(x) for x in range(32)]  # each row once
        p = client.stats("p").partitions["p"]
        assert (p.produced, p.lost, p.tasks["t"].consumed) == (32, 0, 32)
        _until(lambda: _restarted(controller, pid), 60.0)
        assert ray.get(controller.address.remote()) == address
        assert ray.get(controller.units.remote()) == records  # the registry survived

        victim = cluster.units[0]
        unit_pid = ray.get(victim.pid.remote())
        os.kill(unit_pid, signal.SIGKILL)
        _until(lambda: not _unit(client, addresses[0]).alive)
        _until(lambda: _unit(client, addresses[0]).alive, 60.0)  # at its old port
        _until(lambda: _restarted(victim, unit_pid), 60.0)
        assert cluster.unit_addresses == addresses
        assert len(client.stats().units) == 2  # revived under its index, not a new unit
        client.put(_rows(0, 4), "p")


# --- shutdown ---
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _named(name: str, namespace: str | None = None) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _port_free(address: str) -> bool:
    """Nobody listens at ``address`` and a server could bind it again (with SO_REUSEADDR, as
    libzmq binds: a unit's port keeps TIME_WAIT connections, the unit having closed them)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        if s.connect_ex((host, int(port))) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
            s.listen()
        except OSError:
            return False
    return True


def test_close_leaves_no_actor_process_or_port(nodes: list[str]) -> None:
    cluster = tqstream.ray.launch(name="down")
    actors = [cluster.controller, *cluster.units]
    pids = ray.get([x.pid.remote() for x in actors])
    addresses = [cluster.address, *cluster.unit_addresses]
    assert len(addresses) == 4
    with cluster.connect() as client:
        client.put(_rows(0, 4), "p")
    t0 = time.monotonic()
    cluster.close()
    took = time.monotonic() - t0
    assert not any(_named(x) for x in ["down-controller"] + [f"down-unit-{i}" for i in range(3)])
    _until(lambda: all(_gone(p) for p in pids), 5.0)
    assert all(_port_free(x) for x in addresses)
    cluster.close()  # idempotent
    with pytest.warns(DeprecationWarning, match=r"use RayCluster\.close\(\)"):
        cluster.shutdown()  # the old name
    assert took < 15.0, f"close took {took:.1f}s"


def test_a_detached_cluster_is_found_and_shut_down_by_name(nodes: list[str]) -> None:
    ns = "tqstream-tests"  # not this job's: how other jobs share a cluster
    cluster = tqstream.ray.launch(1, name="kept", namespace=ns, detached=True, num_cpus=0)
    pids = ray.get([x.pid.remote() for x in (cluster.controller, *cluster.units)])
    with tqstream.ray.connect(name="kept", namespace=ns) as client:
        assert client.address == cluster.address
    with pytest.raises(tqstream.ConnectError):
        tqstream.ray.connect(name="kept")  # this job's namespace has no such cluster
    assert tqstream.ray.shutdown(name="kept", namespace=ns) is True
    assert not _named("kept-controller", ns) and not _named("kept-unit-0", ns)
    _until(lambda: all(_gone(p) for p in pids), 5.0)
    assert tqstream.ray.shutdown(name="kept", namespace=ns) is False


def test_an_actor_that_cannot_start_stops_the_launch(nodes: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind((ray.util.get_node_ip_address(), 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="a tqstream controller actor failed to start"):
            tqstream.ray.launch(1, name="clash", port=port, num_cpus=0)
    _until(lambda: not _named("clash-controller"))


_DRIVER = """
import os, sys, time, ray, tqstream.ray
ray.init(address=sys.argv[1], log_to_driver=False)
cluster = tqstream.ray.launch(1, name="orphan", num_cpus=0)
actors = [cluster.controller, *cluster.units]
print(*ray.get([a.pid.remote() for a in actors]), flush=True)
time.sleep(600)
"""


def test_the_actors_end_with_the_driver_that_launched_them(nodes: list[str]) -> None:
    address = ray.get_runtime_context().gcs_address
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout is not None
        pids = [int(x) for x in driver.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        driver.kill()
        driver.wait()
    _until(lambda: all(_gone(p) for p in pids), 30.0)
    _until(lambda: not _named("orphan-controller") and not _named("orphan-unit-0"), 10.0)


# --- discovery ---
@ray.remote(num_cpus=0)
def _roundtrip(name: str) -> tuple[list[str], str]:
    with tqstream.ray.connect(name=name) as client:  # the cluster's key file comes with it
        client.put(_rows(0, 4), "task", keys=["a", "b", "c", "d"])
        batch = client.get("task", "x", 4, "t", timeout=10)
        batch.ack()
        return list(batch.meta.keys), client.config.keys


@ray.remote(num_cpus=0)
def _connect_error(name: str) -> str:
    try:
        tqstream.ray.connect(name=name)
    except tqstream.ConnectError as exc:
        return str(exc)
    return "connected"


def test_connect_by_name_from_a_ray_task(nodes: list[str], tmp_path: Path) -> None:
    keys = str(tmp_path / "cluster.keys")
    with tqstream.ray.launch(1, name="found", keys=keys, num_cpus=0) as cluster:
        ref = _roundtrip.options(scheduling_strategy=_on(nodes[2])).remote("found")
        assert ray.get(ref, timeout=120) == (["a", "b", "c", "d"], keys)
        with pytest.raises(tqstream.AuthenticationError):  # the servers want the keys
            tqstream.connect(cluster.address, tqstream.ClientConfig(connect_timeout=3.0))
        with pytest.raises(ValueError, match="already runs in Ray namespace"):
            tqstream.ray.launch(1, name="found", num_cpus=0)


def test_an_unknown_name_is_a_connect_error_naming_it(nodes: list[str]) -> None:
    namespace = ray.get_runtime_context().namespace
    with pytest.raises(tqstream.ConnectError) as err:
        tqstream.ray.connect(name="nosuch")
    assert f"no tqstream cluster named 'nosuch' runs in Ray namespace {namespace!r}" in str(
        err.value
    )
    assert "tqstream.ray.launch(name='nosuch')" in str(err.value)
    message = ray.get(_connect_error.remote("nosuch"), timeout=60)
    assert "no tqstream cluster named 'nosuch'" in message and namespace in message
    with pytest.raises(tqstream.ConnectError, match="namespace 'elsewhere'"):
        tqstream.ray.connect(name="nosuch", namespace="elsewhere")
    assert tqstream.ray.shutdown(name="nosuch") is False


def test_launch_refuses_bad_placement(nodes: list[str]) -> None:
    with pytest.raises(ValueError, match="nodes must name alive Ray nodes"):
        tqstream.ray.launch(name="bad", nodes=["0" * 56])
    with pytest.raises(ValueError, match="replicas=2 needs at least 2 storage units"):
        tqstream.ray.launch(1, name="bad", replicas=2)
    with pytest.raises(ValueError, match="no alive Ray node has 64 CPUs"):
        tqstream.ray.launch(name="bad", num_cpus=64)


def test_launch_takes_a_cluster_config_and_the_old_names(nodes: list[str]) -> None:
    """``config=`` reaches the actors (the quota and the row cap apply); ``num_storage_units``
    still works, with a DeprecationWarning; actors reserving every CPU of their nodes get a
    RuntimeWarning naming them (tasks needing a CPU there would wait); settings the Ray
    deployment cannot apply, or an old name given with its new one, are refused before anything
    starts."""
    config = tqstream.ClusterConfig().with_settings(storage_max_bytes=123456, max_rows=4)
    with (
        pytest.warns(DeprecationWarning, match="use 'storage_units'"),
        pytest.warns(RuntimeWarning, match=r"reserve every CPU of node") as crowded,
    ):
        cluster = tqstream.ray.launch(
            name="configured",
            config=config,
            num_storage_units=2,
            nodes=nodes[1:],
            num_cpus=4,
            controller_node=nodes[0],
        )
    text = str(next(w.message for w in crowded if w.category is RuntimeWarning))
    for node in nodes:  # the controller on the head, a unit on each other node: 4 of 4 CPUs
        assert f"node {node} (1 of them, 4 of its 4 CPUs)" in text, text
    assert "launch with num_cpus=0" in text
    with cluster, cluster.connect() as client:
        assert [u.max_bytes for u in client.stats().units] == [123456, 123456]
        client.put(_rows(0, 4), "p")
        with pytest.raises(tqstream.CapacityError, match="max_rows=4"):
            client.put(_rows(4, 1), "p")
    with pytest.raises(tqstream.ConfigError, match="binds each actor to its node's IP"):
        tqstream.ray.launch(name="bad", host="0.0.0.0")
    with pytest.raises(tqstream.ConfigError, match="both were given"):
        tqstream.ray.launch(1, name="bad", num_storage_units=2)
    assert not _named("bad-controller")


def test_without_ray_the_import_error_says_how_to_install() -> None:
    code = "import sys; sys.modules['ray'] = None; import tqstream.ray"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 1
    assert 'pip install "tqstream[ray]"' in out.stderr
