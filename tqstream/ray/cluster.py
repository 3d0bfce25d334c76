"""``launch`` a tqstream cluster as Ray actors, ``connect`` to it by name, ``shutdown`` it by name.

Ray does placement, discovery and lifecycle: the controller actor is named ``<name>-controller``
in a Ray namespace, the storage units ``<name>-unit-<i>``; clients look the controller up by name
and from then on talk to the servers over tqstream's own sockets (shared memory with units on their
host), never through Ray.

Lifetimes: the actors belong to the process that launched them (Ray ends them when it exits)
unless ``detached=True``, and ``RayCluster.close()`` ends them at once: each actor closes its
sockets first, so its ports are free, then Ray kills it and ``close`` waits until it is gone.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tqstream.config import ClientConfig, ClusterConfig, ControllerConfig, cluster_config, from_env
from tqstream.errors import ConfigError, ConnectError
from tqstream.protocol.shm import process_key
from tqstream.ray.actors import ControllerActor, StorageUnitActor, controller_name, unit_name

if TYPE_CHECKING:
    from tqstream.client.client import Client

__all__ = ["RayCluster", "connect", "launch", "shutdown"]

STOP_TIMEOUT = 10.0
"""Seconds ``close`` waits for an actor to close its sockets before killing it anyway."""

GONE_TIMEOUT = 30.0
"""Seconds ``close`` waits for Ray to report a killed actor dead and release its name."""

_Controller: Any = ray.remote(ControllerActor)
_Unit: Any = ray.remote(StorageUnitActor)


class RayCluster:
    """A tqstream cluster of Ray actors, as ``launch`` returns it (or ``attach`` finds it).

    ``address``: the controller's ``tcp://IP:PORT``. ``controller`` / ``units``: the actor
    handles (``units[i]`` is storage unit ``i`` of the launch, ``<name>-unit-<i>``). Use it as a
    context manager, or call ``close()``."""

    def __init__(
        self,
        name: str,
        namespace: str,
        controller: Any,
        units: dict[int, Any],
        keys: str = "",
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.controller = controller
        self.units = [units[i] for i in sorted(units)]
        self._indices = sorted(units)
        self.keys = keys
        """The cluster's key file ("": none); ``connect`` hands it to clients."""
        self.address: str = ray.get(controller.address.remote())
        self._closed = False

    @classmethod
    def attach(cls, name: str = "tqstream", *, namespace: str | None = None) -> RayCluster:
        """The cluster ``name`` launched by another process (e.g. ``detached=True``), to connect
        to it or shut it down; ConnectError if there is none."""
        namespace = _namespace(namespace)
        controller = _controller(name, namespace)
        _, keys = ray.get(controller.endpoint.remote())
        units = {}
        for i in ray.get(controller.units.remote()):
            try:
                units[i] = ray.get_actor(unit_name(name, i), namespace=namespace)
            except ValueError:  # that unit ended for good
                continue
        return cls(name, namespace, controller, units, keys)

    @property
    def unit_addresses(self) -> list[str]:
        """Each storage unit's address, by launch index (a restarted unit keeps its address)."""
        records = ray.get(self.controller.units.remote())
        return [records[i].address for i in sorted(records)]

    @property
    def metrics_address(self) -> str:
        """The controller's ``http://IP:PORT/metrics``, or "" without ``metrics_port``."""
        return str(ray.get(self.controller.metrics_address.remote()))

    def connect(self, config: ClientConfig | None = None) -> Client:
        """A client of this cluster (with its key file when ``config`` names none)."""
        from tqstream.client.client import Client

        return Client(self.address, _with_keys(config, self.keys))

    def close(self) -> None:
        """Stop every actor and wait until it is gone: Ray reports it dead, its name is free,
        and its process has exited (watched where this process can see it: the same host).
        Idempotent. Clients still connected get ConnectionLostError."""
        if self._closed:
            return
        self._closed = True
        actors = [*self.units, self.controller]
        processes = _processes(actors)
        # the units first: the side that closes a TCP connection first keeps it in TIME_WAIT,
        # which must not be the controller's port
        for group in (self.units, [self.controller]):
            _stop(group)
            for actor in group:
                ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + GONE_TIMEOUT
        for actor in actors:
            _wait_dead(actor, deadline)
        names = [controller_name(self.name)] + [unit_name(self.name, i) for i in self._indices]
        here = process_key()
        for n in names:  # a name is released a moment after its actor died
            _until(lambda n=n: not _exists(n, self.namespace), deadline, f"actor name {n!r}")
        for pid, key in processes:
            if key and key == here:
                _until(lambda pid=pid: not _running(pid), deadline, f"actor process {pid}")

    def shutdown(self) -> None:
        """Deprecated name of :meth:`close` (the name every tqstream cluster and client uses)."""
        warnings.warn(
            "RayCluster.shutdown() is deprecated and will be removed in the next release: use "
            "RayCluster.close()",
            DeprecationWarning,
            stacklevel=2,
        )
        self.close()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RayCluster(name={self.name!r}, namespace={self.namespace!r}, "
            f"address={self.address!r}, units={len(self.units)})"
        )


def launch(
    storage_units: int | None = None,
    *,
    config: ClusterConfig | None = None,
    name: str = "tqstream",
    namespace: str | None = None,
    nodes: Sequence[str] | None = None,
    controller_node: str | None = None,
    num_cpus: float = 1.0,
    unit_max_restarts: int = -1,
    detached: bool = False,
    timeout: float = 120.0,
    **settings: Any,
) -> RayCluster:
    """Start a controller and storage units as Ray actors; return once every unit serves.

    ``config``: the cluster (:class:`tqstream.ClusterConfig`; None: the defaults, then the
    ``TQSTREAM_*`` variables of this process); ``storage_units`` and the keyword ``settings``
    change it by name, as every deployment takes them (docs/deployment.md): ``port`` (the
    controller's; 0: a free one), ``storage_max_bytes``, ``replicas``, ``lease_timeout``,
    ``max_rows``, ``metrics_port`` (the controller's Prometheus endpoint), ``keys`` (the cluster's
    CURVE key file, made here if missing; it must be readable at this path on every node, and by
    clients), ... Each actor binds its node's IP, so ``host`` is not taken.

    Placement: the storage units go one per node, in turn over ``nodes`` (Ray node ids; default:
    every alive node with ``num_cpus`` CPUs), so ``storage_units`` unset is one unit per node;
    the controller goes on ``controller_node``, else on this process's node (if it has room,
    unless it has a journal: then there and nowhere else).
    ``num_cpus``: logical CPUs each actor reserves (0 allowed); they take no GPU. When they
    reserve every CPU of a node, ``launch`` warns (``RuntimeWarning``): a task or actor that
    needs a CPU there would wait for as long as the cluster runs.

    ``name``: the cluster's name in the Ray ``namespace`` (default: this job's), how
    :func:`connect` finds it. ``detached``: the actors outlive this process (end them with
    :func:`shutdown`); by default Ray ends them with it. ``unit_max_restarts``: how often Ray
    restarts a storage unit whose process died (-1: always); a restarted unit serves at its old
    address and the controller revives it, empty. The controller is restarted only with a
    journal (``durability="batched"`` or ``"sync"`` and ``journal=DIR``, a directory of the
    controller's node): Ray restarts it there, always, at its old port; it replays the journal
    and clients and units carry on (docs/faults.md). Without a journal it is never restarted: its
    death ends the cluster.
    ``timeout``: seconds to wait for the actors to be placed and serving, then RuntimeError
    (everything started is stopped).
    """
    config = cluster_config(config, storage_units=storage_units, **settings)
    if config.controller.host != ControllerConfig.host:
        raise ConfigError(
            f"host={config.controller.host!r}: the Ray deployment binds each actor to its node's "
            f"IP; leave host unset (TQSTREAM_HOST too)",
            setting="host",
        )
    if num_cpus < 0:
        raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
    if not ray.is_initialized():
        ray.init()
    namespace = _namespace(namespace)
    if _exists(controller_name(name), namespace):
        raise ValueError(
            f"a tqstream cluster named {name!r} already runs in Ray namespace {namespace!r}; "
            f"shut it down (tqstream.ray.shutdown(name={name!r})) or launch with another name"
        )
    placed = _unit_nodes(config.storage_units, nodes, num_cpus)
    replicas = config.controller.replicas
    if replicas > len(placed):
        raise ConfigError(
            f"replicas={replicas} needs at least {replicas} storage units, got {len(placed)}",
            setting="replicas",
        )
    from tqstream.protocol.auth import ensure_keys

    if config.controller.keys:
        config = config.with_settings(keys=os.path.abspath(config.controller.keys))
        ensure_keys(config.controller.keys)  # made here, once: the actors only load it
    durable = config.controller.durability != "off"
    if durable:  # a path of the controller's node, where it runs on every restart
        config = config.with_settings(journal=os.path.abspath(config.controller.journal))
    cc, sc = config.controller, config.storage
    common: dict[str, Any] = {"namespace": namespace, "num_cpus": num_cpus, "num_gpus": 0}
    if detached:
        common["lifetime"] = "detached"
    here = ray.get_runtime_context().get_node_id()
    # with a journal Ray restarts the controller, on the node whose disk holds the journal
    controller = _Controller.options(
        name=controller_name(name),
        max_restarts=-1 if durable else 0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            controller_node or here, soft=controller_node is None and not durable
        ),
        **common,
    ).remote(cc)
    units: list[Any] = []
    try:
        _ready([controller], timeout, "controller", num_cpus)
        for i, node in enumerate(placed):
            units.append(
                _Unit.options(
                    name=unit_name(name, i),
                    max_restarts=unit_max_restarts,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    **common,
                ).remote(i, name, namespace, sc)
            )
        _ready(units, timeout, "storage unit", num_cpus)
        if num_cpus > 0:  # a named controller node is where it runs; else ask (soft affinity)
            at = controller_node or ray.get(controller.node_id.remote())
            _warn_if_crowded([at, *placed], num_cpus)
        return RayCluster(name, namespace, controller, dict(enumerate(units)), cc.keys)
    except BaseException:
        for actor in [*units, controller]:
            ray.kill(actor, no_restart=True)
        raise


def connect(
    name: str = "tqstream",
    *,
    namespace: str | None = None,
    config: ClientConfig | None = None,
    timeout: float = 60.0,
) -> Client:
    """A client of the cluster ``name`` (from any Ray driver, task or actor).

    ``namespace``: the Ray namespace it was launched in (default: this job's; a task or actor
    runs in its job's). The client gets the cluster's key file when ``config`` names none.
    ``timeout``: seconds to wait for the controller actor to answer. ConnectError if no cluster
    of that name runs there, or its controller is dead."""
    from tqstream.client.client import Client

    if not ray.is_initialized():
        raise ConnectError(
            f"tqstream.ray.connect(name={name!r}) needs a Ray connection: call it from a Ray task "
            f"or actor, or call ray.init(address='auto', namespace=...) first"
        )
    namespace = _namespace(namespace)
    controller = _controller(name, namespace)
    try:
        address, keys = ray.get(controller.endpoint.remote(), timeout=timeout)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        raise ConnectError(
            f"the controller of tqstream cluster {name!r} (Ray namespace {namespace!r}) did not "
            f"answer within {timeout:g}s: {exc}",
            name=name,
            namespace=namespace,
        ) from exc
    return Client(address, _with_keys(config, keys))


def shutdown(name: str = "tqstream", *, namespace: str | None = None) -> bool:
    """Shut down the cluster ``name`` wherever it was launched (see ``RayCluster.close``);
    False if no cluster of that name runs in the namespace."""
    try:
        cluster = RayCluster.attach(name, namespace=namespace)
    except ConnectError:
        return False
    cluster.close()
    return True


# --- helpers ---
def _namespace(namespace: str | None) -> str:
    return namespace if namespace is not None else str(ray.get_runtime_context().namespace)


def _exists(actor_name: str, namespace: str) -> bool:
    try:
        ray.get_actor(actor_name, namespace=namespace)
    except ValueError:
        return False
    return True


def _controller(name: str, namespace: str) -> Any:
    try:
        return ray.get_actor(controller_name(name), namespace=namespace)
    except ValueError:
        raise ConnectError(
            f"no tqstream cluster named {name!r} runs in Ray namespace {namespace!r} (no actor "
            f"{controller_name(name)!r}); start one with tqstream.ray.launch(name={name!r}), or "
            f"pass the namespace it was launched in",
            name=name,
            namespace=namespace,
        ) from None


def _with_keys(config: ClientConfig | None, keys: str) -> ClientConfig:
    config = config or from_env(ClientConfig)
    if keys and not config.keys:
        config = dataclasses.replace(config, keys=keys)
    return config


def _unit_nodes(n: int | None, nodes: Sequence[str] | None, num_cpus: float) -> list[str]:
    """The node of each storage unit: ``n`` (default: one per node) in turn over the nodes."""
    alive = [x for x in ray.nodes() if x["Alive"]]
    if nodes is not None:
        known = {x["NodeID"] for x in alive}
        unknown = [x for x in nodes if x not in known]
        if unknown or not nodes:
            raise ValueError(
                f"nodes must name alive Ray nodes; not alive or unknown: "
                f"{unknown or '(none given)'}; alive: {sorted(known)}"
            )
        candidates = list(nodes)
    else:
        candidates = [x["NodeID"] for x in alive if x["Resources"].get("CPU", 0) >= num_cpus]
        if not candidates:
            raise ValueError(
                f"no alive Ray node has {num_cpus:g} CPUs for a storage unit; pass num_cpus=0 "
                f"or nodes=[...]"
            )
        here = ray.get_runtime_context().get_node_id()
        candidates.sort(key=lambda x: x != here)  # a single unit goes next to this process
    count = len(candidates) if n is None else n
    return [candidates[i % len(candidates)] for i in range(count)]


def _warn_if_crowded(actor_nodes: Sequence[str], num_cpus: float) -> None:
    """Warn when the actors, on ``actor_nodes``, reserve every CPU of a node: a Ray task or actor
    that needs one there (a rollout, say) would wait for as long as the cluster runs."""
    totals = {x["NodeID"]: x["Resources"].get("CPU", 0.0) for x in ray.nodes() if x["Alive"]}
    full = [
        f"node {node} ({count} of them, {count * num_cpus:g} of its {totals[node]:g} CPUs)"
        for node, count in Counter(actor_nodes).items()
        if node in totals and totals[node] - count * num_cpus < 1
    ]
    if full:
        warnings.warn(
            f"tqstream's actors (num_cpus={num_cpus:g} each) reserve every CPU of "
            f"{', '.join(full)}: Ray tasks and actors that need a CPU there wait for one as long "
            f"as the cluster runs; launch with num_cpus=0 (the actors mostly wait on their "
            f"sockets) or on nodes with more CPUs",
            RuntimeWarning,
            stacklevel=3,
        )


def _ready(actors: list[Any], timeout: float, what: str, num_cpus: float) -> None:
    """Wait until every actor's ``__init__`` returned (so it serves); its error if it failed."""
    try:
        ray.get([a.address.remote() for a in actors], timeout=timeout)
    except ray.exceptions.RayActorError as exc:  # its __init__ raised, e.g. a port in use
        raise RuntimeError(f"a tqstream {what} actor failed to start: {exc}") from exc
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"the tqstream {what} actors did not start within {timeout:g}s: each needs "
            f"num_cpus={num_cpus:g} free on its node (`ray status` lists pending actors); pass "
            f"a smaller num_cpus, other nodes, or a longer timeout"
        ) from None


def _stop(actors: list[Any]) -> None:
    """Ask each actor to close its sockets; one that is dead or does not answer is killed."""
    pending = {a.stop.remote(): a for a in actors}
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=STOP_TIMEOUT)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError:
            continue  # dead or restarting: the kill below ends it anyway


def _processes(actors: list[Any]) -> list[tuple[int, str]]:
    """``(pid, process key)`` of each actor that answers (a dead one has no process to wait for)."""
    refs = [a.process.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT)
    out = []
    for ref in ready:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError:
            continue
    return out


def _wait_dead(actor: Any, deadline: float) -> None:
    """Until Ray reports the (killed) actor dead."""
    while True:
        try:
            ray.get(actor.pid.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorDiedError:
            return
        except ray.exceptions.RayError:
            pass  # restarting, or not answering yet
        if time.monotonic() >= deadline:
            raise RuntimeError(f"Ray did not end tqstream actor {actor} within {GONE_TIMEOUT:g}s")
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether process ``pid`` (of this host) still runs; a zombie holds nothing any more."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _until(done: Any, deadline: float, what: str) -> None:
    while not done():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"tqstream shutdown: {what} still there after {GONE_TIMEOUT:g}s")
        time.sleep(0.02)
