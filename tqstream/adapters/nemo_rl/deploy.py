"""Reach the tqstream cluster a NeMo-RL job uses: connect to an address, attach to a Ray-launched
cluster by name, or (driver only, ``bootstrap=True``) start one.

NeMo-RL builds one data-plane client per process: the driver with ``bootstrap=True``, every policy
worker, rollout actor and the async controller with ``bootstrap=False``. Under Ray the cluster is
found by name from any of them. Started embedded or as child processes, the driver writes the
cluster's address into the configuration dict as ``controller_address``, so the configuration it
hands to its workers afterwards leads them to the same cluster.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from tqstream.adapters.nemo_rl.config import TQStreamDataPlaneConfig
from tqstream.adapters.nemo_rl.errors import ConfigError
from tqstream.client.client import Client, connect
from tqstream.errors import ConnectError

__all__ = ["open_cluster"]

Closer = Callable[[], None]


def open_cluster(
    config: TQStreamDataPlaneConfig, bootstrap: bool, cfg: Any = None
) -> tuple[Client, Closer | None]:
    """A client of the job's cluster, and what stops the cluster when this process started it
    (None otherwise). ``cfg``: NeMo-RL's configuration dict, which receives the address of a
    cluster started here outside Ray."""
    if config.address:
        return connect(config.address), None
    if config.launch == "ray":
        return _ray(config, bootstrap)
    if not bootstrap:
        raise ConfigError(
            f"data_plane has no controller_address and tqstream.launch is {config.launch!r}: a "
            f"worker (bootstrap=False) cannot find the cluster; build the driver's client first "
            f"(bootstrap=True) and hand its configuration on, or set controller_address"
        )
    units = config.storage_units or 1
    if config.launch == "embedded":
        import tqstream

        client: Client = tqstream.init(storage_units=units)
        stop = None  # closing the client stops its embedded servers
    else:
        from tqstream.launch.processes import ProcessCluster

        cluster = ProcessCluster(units)
        try:
            client = connect(cluster.address)
        except BaseException:
            cluster.close()
            raise
        stop = cluster.close
    if isinstance(cfg, MutableMapping):
        cfg["controller_address"] = client.address
    return client, stop


def _ray(config: TQStreamDataPlaneConfig, bootstrap: bool) -> tuple[Client, Closer | None]:
    import tqstream.ray as ray_cluster  # imports Ray: only for a configuration that asks for it

    name, namespace = config.ray_name, config.ray_namespace
    try:
        return ray_cluster.connect(name, namespace=namespace), None
    except ConnectError:
        if not bootstrap:
            raise
    cluster = ray_cluster.launch(config.storage_units, name=name, namespace=namespace)
    try:
        return cluster.connect(), cluster.close
    except BaseException:
        cluster.close()
        raise
