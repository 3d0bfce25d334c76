"""Where ``transfer_queue.init()`` finds or starts the tqstream cluster of a job.

TransferQueue's processes find each other through a Ray actor named ``TransferQueueController``
in Ray namespace ``transfer_queue``: the driver's ``init(conf)`` creates it, a bare ``init()``
anywhere else in the job (a Ray worker, an agent-loop actor) looks it up. The same name is kept
here, for an actor that only records the cluster (its address, key file and the merged config)
and answers TransferQueue's actor-level calls (``get_config``, ``list_partitions``,
``clear_partition``); the cluster itself is tqstream's: a controller and storage units as Ray
actors (:mod:`tqstream.ray`), moving data over tqstream's sockets, never through Ray.

Without Ray, the cluster runs in the driver's process (tqstream's embedded deployment) and the
driver exports its address in ``TQSTREAM_TRANSFER_QUEUE_ADDRESS``, so processes it starts later
attach to it with a bare ``init()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from tqstream.compat.transfer_queue.config import ADDRESS_ENV, KEYS_ENV, Settings
from tqstream.compat.transfer_queue.errors import ForeignControllerError
from tqstream.config import ClientConfig, ClusterConfig, from_env

__all__ = ["ACTOR", "NAMESPACE", "Found", "Started", "find", "start"]

_log = logging.getLogger("tqstream.compat")

ACTOR = "TransferQueueController"
NAMESPACE = "transfer_queue"
CLUSTER = "transfer_queue"
"""The tqstream Ray cluster's name (its actors: ``transfer_queue-controller``, ``-unit-<i>``)."""


@dataclasses.dataclass
class Found:
    """A cluster to connect to: its address, key file ("" : none) and the merged config."""

    address: str
    keys: str
    conf: dict[str, Any]

    def client_config(self) -> ClientConfig:
        config = from_env(ClientConfig)
        if self.keys and not config.keys:
            config = dataclasses.replace(config, keys=self.keys)
        return config


@dataclasses.dataclass
class Started(Found):
    """A cluster this process started; ``stop()`` ends it (and its Ray actors)."""

    stop: Callable[[], None] = lambda: None
    client: Any = None  # the embedded deployment's own client (its servers' owner)


def find(use_ray: bool = True) -> Found | None:
    """The job's cluster: the address this process inherited, or (``use_ray``) the Ray actor of
    the job. An actor of that name that is not tqstream's (TransferQueue's own controller, in a
    job that runs both) raises :class:`ForeignControllerError`."""
    address = os.environ.get(ADDRESS_ENV)
    if address:
        return Found(address, os.environ.get(KEYS_ENV, ""), {})
    if not use_ray:
        return None
    ray = _ray()
    if ray is None or not ray.is_initialized():
        return None
    try:
        actor = ray.get_actor(ACTOR, namespace=NAMESPACE)
    except ValueError:
        return None
    try:
        address, keys, conf = ray.get(actor.endpoint.remote())
    except AttributeError:  # the actor has no endpoint(): TransferQueue's own controller
        raise ForeignControllerError(
            f"Ray namespace {NAMESPACE!r} already holds an actor {ACTOR!r} that is not "
            "tqstream's: TransferQueue itself runs in this Ray job. Run one of the two per job "
            "(unset TQSTREAM_TRANSFER_QUEUE or stop TransferQueue), or keep tqstream's cluster "
            "out of Ray with init({'tqstream': {'deployment': 'embedded'}})"
        ) from None
    return Found(address, keys, conf)


def start(settings: Settings, conf: dict[str, Any]) -> Started:
    """Start the job's cluster: Ray actors when Ray is initialised (``tqstream.deployment``
    "auto"), else the embedded deployment in this process."""
    ray = _ray()
    use_ray = settings.deployment == "ray" or (
        settings.deployment == "auto" and ray is not None and ray.is_initialized()
    )
    metrics_port = (settings.metrics_port or _free_port()) if settings.metrics else None
    cluster = ClusterConfig.from_env(  # what the config leaves unset: tqstream's environment
        storage_units=settings.storage_units,
        lease_timeout=settings.lease_timeout,
        put_timeout=settings.put_timeout,
        storage_max_bytes=settings.storage_max_bytes or None,
        replicas=settings.replicas,
        keys=settings.keys,
        metrics_port=metrics_port,
        max_rows=settings.max_rows or None,
    )
    if use_ray:
        return _start_ray(settings, conf, cluster)
    return _start_embedded(conf, cluster)


def _start_embedded(conf: dict[str, Any], cluster: ClusterConfig) -> Started:
    import tqstream

    client = tqstream.init(config=cluster)
    metrics_port = cluster.controller.metrics_port
    keys = client.config.keys
    os.environ[ADDRESS_ENV] = client.address
    if keys:
        os.environ[KEYS_ENV] = keys

    def stop() -> None:
        for name in (ADDRESS_ENV, KEYS_ENV):
            if os.environ.get(name) == (client.address if name == ADDRESS_ENV else keys):
                del os.environ[name]
        client.close()

    _endpoint(conf, f"127.0.0.1:{metrics_port}" if metrics_port else None)
    _log.info("transfer_queue: tqstream cluster in this process at %s", client.address)
    return Started(client.address, keys, conf, stop, client)


def _start_ray(settings: Settings, conf: dict[str, Any], config: ClusterConfig) -> Started:
    import ray

    import tqstream.ray

    cluster = tqstream.ray.launch(
        config=config, name=CLUSTER, namespace=NAMESPACE, num_cpus=settings.num_cpus
    )
    try:
        metrics = cluster.metrics_address
        _endpoint(conf, metrics.removeprefix("http://").removesuffix("/metrics") or None)
        from tqstream.compat.transfer_queue.actor import TransferQueueController

        actor: Any = (
            ray.remote(TransferQueueController)
            .options(name=ACTOR, namespace=NAMESPACE, num_cpus=0, max_restarts=0)
            .remote(cluster.address, cluster.keys, conf)
        )
        ray.get(actor.endpoint.remote())
    except BaseException:
        cluster.close()
        raise

    def stop() -> None:
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        cluster.close()

    _log.info(
        "transfer_queue: tqstream cluster as Ray actors (namespace %r) at %s",
        NAMESPACE,
        cluster.address,
    )
    return Started(cluster.address, cluster.keys, conf, stop)


def _endpoint(conf: dict[str, Any], endpoint: str | None) -> None:
    if endpoint:
        conf.setdefault("metrics", {})["endpoint"] = endpoint
        conf["metrics"]["enabled"] = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        return None
    return ray
