"""One ``ClusterConfig`` for every deployment: what it says reaches the servers (seen through the
public API: stats and behaviour), in the embedded cluster and in the child processes alike; old
keyword names still work, with a DeprecationWarning."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch

import tqstream
from tqstream import ClusterConfig, ConfigError
from tqstream.launch.processes import ProcessCluster

CONFIG = ClusterConfig(storage_units=2).with_settings(
    storage_max_bytes=123_456, replicas=2, max_rows=4, lease_timeout=50.0
)


@contextmanager
def _embedded(**kwargs: Any) -> Iterator[tqstream.Client]:
    with tqstream.init(**kwargs) as client:
        yield client


@contextmanager
def _processes(**kwargs: Any) -> Iterator[tqstream.Client]:
    with ProcessCluster(**kwargs) as cluster, tqstream.connect(cluster.address) as client:
        yield client


DEPLOYMENTS: dict[str, Callable[..., AbstractContextManager[tqstream.Client]]] = {
    "embedded": _embedded,
    "processes": _processes,
}


@pytest.mark.parametrize("deploy", sorted(DEPLOYMENTS))
def test_a_config_reaches_the_servers(deploy: str) -> None:
    with DEPLOYMENTS[deploy](config=CONFIG, put_timeout=20.0) as client:
        assert [u.max_bytes for u in client.stats().units] == [123_456, 123_456]
        client.put({"x": torch.ones(2)}, "p")
        assert client.stats().partitions["p"].replicas == 2
        with pytest.raises(tqstream.CapacityError, match="max_rows=4"):
            client.put({"x": torch.ones(3)}, "p")


@pytest.mark.parametrize("deploy", sorted(DEPLOYMENTS))
def test_old_names_warn_and_work(deploy: str) -> None:
    with (
        pytest.warns(DeprecationWarning, match="use 'storage_max_bytes'"),
        DEPLOYMENTS[deploy](max_bytes=4096) as client,
    ):
        assert [u.max_bytes for u in client.stats().units] == [4096]


def test_bad_settings_are_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="'num_storage_units' is the deprecated name"):
        ProcessCluster(2, num_storage_units=2)
    with pytest.raises(ConfigError, match="unknown cluster setting 'max_byte'"):
        ProcessCluster(max_byte=1)
    with pytest.raises(ConfigError, match="the embedded cluster binds loopback only"):
        tqstream.init(host="0.0.0.0")
    with pytest.raises(ConfigError, match="storage_units must be at least 1"):
        tqstream.init(config=CONFIG, storage_units=0)


def test_storage_timeout_reaches_the_controller_process() -> None:
    """A setting once reachable only through the environment: with ``storage_timeout=1`` the
    stats of a cluster whose unit is frozen come back within seconds, the unit marked down
    (heartbeats slowed down so that they do not declare it lost first)."""
    with (
        ProcessCluster(1, storage_timeout=1.0, heartbeat_interval=30.0) as cluster,
        tqstream.connect(cluster.address) as client,
    ):
        assert client.stats().units[0].alive
        unit = cluster.procs[1].pid
        os.kill(unit, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stats = client.stats()
            took = time.monotonic() - t0
        finally:
            os.kill(unit, signal.SIGCONT)
        assert not stats.units[0].alive and took < 10.0, took
