"""Configuration: one frozen dataclass per component, every field with a default and a docstring,
and :class:`ClusterConfig`, the one description of a cluster that every deployment takes.

A cluster setting has one name everywhere (:func:`cluster_settings`): the keyword of
``tqstream.init``, ``tqstream.ProcessCluster``, ``tqstream.ray.launch`` and
``ClusterConfig.with_settings``, the ``tqstream-launch`` flag (``--storage-max-bytes``) and the
environment variable (``TQSTREAM_STORAGE_MAX_BYTES``). The names come from the fields: a
controller field's own name, a storage unit's field with ``storage_`` in front, and one name for a
field both have (``keys``, ``host``, ``max_message_bytes``, ...), which sets it in both. A new
field is therefore one edit here: every deployment, flag and variable takes it. Old names
(:data:`DEPRECATED`) still work, with a ``DeprecationWarning``.

Environment variables are read here and nowhere else (``TQSTREAM_<SETTING>`` in upper case, e.g.
``TQSTREAM_LEASE_TIMEOUT=60``; a client's ``TQSTREAM_<FIELD>`` of :class:`ClientConfig`); explicit
arguments win over the environment.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import ipaddress
import itertools
import os
import sys
import types
import typing
import warnings
from typing import Any, TypeVar

from tqstream.errors import ConfigError

__all__ = [
    "ADDRESS_ENV",
    "AREAL_BUDGET_ENV",
    "DEPRECATED",
    "ClientConfig",
    "ClusterConfig",
    "ControllerConfig",
    "Setting",
    "StorageConfig",
    "cluster_config",
    "cluster_settings",
    "environment",
    "from_env",
    "is_loopback",
]

ADDRESS_ENV = "TQSTREAM_ADDRESS"
"""The cluster a process uses when it is given no client (``tqstream/launch/default.py``): a
``tcp://HOST:PORT`` address (its key file, if any, in ``TQSTREAM_KEYS``); unset: the process
starts its own embedded cluster."""
AREAL_BUDGET_ENV = "TQSTREAM_AREAL_BUDGET"
"""The budget that AReaL ``StalenessManager`` s built without a name share (set it for every
rank: ``docs/adapters/areal.md``); unset: each keeps a budget of its own."""

DEPRECATED = {"max_bytes": "storage_max_bytes", "num_storage_units": "storage_units"}
"""Old names of cluster settings, each with its new one: accepted as keywords and as
``TQSTREAM_<OLD>`` variables with a ``DeprecationWarning`` until the next release."""

GiB = 1 << 30
DEFAULT_MAX_MESSAGE_BYTES = 2 * GiB


@dataclasses.dataclass(frozen=True)
class _ServerConfig:
    """What the controller and the storage units both take: in a cluster one setting of each name
    sets both (:func:`cluster_settings`)."""

    host: str = "127.0.0.1"
    """Interface to bind (in a cluster: every server's); loopback by default."""
    port: int = 0
    """TCP port (in a cluster: the controller's, which clients connect to; every storage unit
    picks its own); 0 picks a free one."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted; larger ones get a MessageTooLargeError reply."""
    keys: str = ""
    """Path of the cluster's CURVE key file, made (mode 0600) if missing when a deployment starts:
    TCP peers must hold its client keypair (clients: ``ClientConfig(keys=PATH)`` or
    ``TQSTREAM_KEYS=PATH``); empty: no authentication, any peer that reaches the port is served."""
    connect_timeout: float = 10.0
    """Seconds the controller and a registering storage unit wait for each other's handshake
    before raising ConnectError."""
    heartbeat_interval: float = 1.0
    """Seconds between ZMQ heartbeats on the links between the controller and the storage units;
    a side silent for 3 intervals counts as lost."""


@dataclasses.dataclass(frozen=True)
class ControllerConfig(_ServerConfig):
    lease_timeout: float = 300.0
    """Seconds a leased batch stays leased without ack before its rows become available again."""
    put_timeout: float = 60.0
    """Seconds a prepared put may stay uncommitted before it is aborted and its storage freed."""
    storage_timeout: float = 30.0
    """Seconds to wait for a storage unit to answer a drop or stats request."""
    replicas: int = 1
    """Copies kept of each row, on distinct storage units (1 or 2); a partition can set its own
    (``create_partition(..., replicas=2)``). With 2, losing one unit loses no row."""
    metrics_port: int = 0
    """Port of the Prometheus metrics endpoint (``http://HOST:PORT/metrics`` on the controller's
    host); 0: no endpoint (docs/observability.md)."""
    max_rows: int = 0
    """Rows the cluster holds at most, over every partition (rows being put included); a put or
    keyed write that would exceed it raises CapacityError. 0: no cap."""
    durability: str = "off"
    """What a controller's death may lose (docs/faults.md): ``"off"``, everything (it is not
    restarted); ``"batched"``, nothing a client was told: every state change is written to the
    journal before its reply leaves, fsynced at most every ``fsync_interval`` (a machine's crash
    loses that much); ``"sync"``, nothing even then (fsync before the reply). With ``batched`` and
    ``sync`` a controller that dies is restarted at its address, replays its journal, and clients
    carry on; they need ``journal``."""
    journal: str = ""
    """Directory of the controller's journal (made if missing; one cluster's alone), needed with
    ``durability`` ``batched`` or ``sync``; a controller started on a journal resumes its state."""
    fsync_interval: float = 0.005
    """``durability="batched"``: seconds between the journal's fsyncs at most."""
    snapshot_records: int = 200_000
    """Journal records after which the controller writes a snapshot of its state and starts a
    fresh journal: what a restart replays at most."""
    reconnect_grace: float = 30.0
    """Seconds a restarted controller waits for the clients it knew to reconnect; what one that
    did not come back held (puts in flight, leases, admission slots) is then rolled back, as for a
    client whose connection dropped."""

    def __post_init__(self) -> None:
        _check(self, "controller")
        if self.durability != "off" and not self.journal:
            raise ConfigError(
                f"durability={self.durability!r} needs a journal directory: pass journal=DIR "
                f"(tqstream-launch --journal DIR, TQSTREAM_JOURNAL)",
                setting="journal",
            )


@dataclasses.dataclass(frozen=True)
class StorageConfig(_ServerConfig):
    max_bytes: int = 0
    """Byte quota of each storage unit (0: unlimited); puts wait for room, then raise
    CapacityError."""

    def __post_init__(self) -> None:
        _check(self, "storage")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    connect_timeout: float = 10.0
    """Seconds to wait for a server's handshake before raising ConnectError."""
    request_timeout: float = 120.0
    """Seconds to wait for a reply to a request that does not park (everything but get_meta)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message sent; the smaller of this and the server's limit applies."""
    heartbeat_interval: float = 1.0
    """Seconds between ZMQ heartbeats; a peer silent for 3 intervals counts as lost."""
    shared_memory: str = "auto"
    """Tensor bytes to and from a storage unit on this host: ``"auto"`` moves them through shared
    memory when the unit is reachable that way and over ZMQ frames otherwise; ``"off"`` always
    uses ZMQ frames."""
    shared_memory_min_bytes: int = 1 << 20
    """Chunks smaller than this are put as frames even when shared memory is available: for them
    a message is as fast as mapping a segment (docs/benchmarks.md)."""
    direct_put_bytes: int = 16 << 20
    """Puts of fewer bytes go to one storage unit in one exchange (units in turn; the unit has the
    controller commit them), their bytes as one frame or, from ``shared_memory_min_bytes`` on,
    through the unit's shared memory; larger puts are placed by the controller first (spread over
    units by load). 0: every put is placed first."""
    keys: str = ""
    """Path of the cluster's CURVE key file (the one ``tqstream-launch --keys`` names), needed to
    reach a cluster started with keys; empty: connect without (docs/security.md)."""
    locality: str = "host"
    """``"host"``: puts go to the storage units on this host first (those whose shared memory
    this process reaches: one copy, no network), unless their quotas are full, and a row kept on
    two units is read from the copy on this host; ``"off"``: units in turn, reads from a row's
    first unit."""
    coalesce_window: float | None = 0.0
    """Seconds a one-exchange put waits for other puts of this client to go with it: concurrent
    puts to one partition (``async_put`` from many tasks, ``put`` from many threads) go to a storage
    unit as one message and one commit, each caller getting its own rows (docs/architecture.md).
    0: those issued in the same turn of the client's event loop, no added wait; None: never. Puts
    issued while the client has puts of their kind in flight to every unit they go to also wait
    for one of those to end, and go together (any window but None)."""
    coalesce_rejoin: float = 1.0
    """Coalescing puts: after a coalesced put returned, the next one to go waits, at most this
    fraction of such a put's time, for its callers (the tasks that awaited it, the threads that
    called it) to put again — an agent loop's rollouts ending at random times — when they came
    back that fast the last time and no fewer are owed than wait (docs/architecture.md); 0:
    never."""
    reconnect_timeout: float = 60.0
    """Seconds a request waits for a controller that went away to come back (a controller with a
    journal is restarted and carries on; docs/faults.md) before raising ControllerUnavailableError;
    requests in flight are sent again once it is back, and each is carried out once."""

    def __post_init__(self) -> None:
        _check(self, "")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A whole cluster, as every deployment starts it: ``tqstream.init(config=...)``,
    ``tqstream.ProcessCluster(config=...)`` (``tqstream-launch``: one flag per setting),
    ``tqstream.ray.launch(config=...)``.

    The storage units bind the controller's ``host``, load its key file (``keys``) and take free
    ports (a restarted unit its old one): ``storage.host`` and ``storage.keys`` must equal the
    controller's and ``storage.port`` must be 0. :meth:`with_settings` changes settings by name and
    sets a shared one in both components, e.g. ``ClusterConfig(storage_units=2).with_settings(
    keys="cluster.keys", storage_max_bytes=8 << 30)``.
    """

    storage_units: int | None = None
    """Number of storage units (at least 1); unset: one per alive Ray node with
    ``tqstream.ray.launch``, else 1."""
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    """The controller's settings."""
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    """Every storage unit's settings."""

    def __post_init__(self) -> None:
        _check(self, "")
        for name, what in (("host", "interface to bind"), ("keys", "key file")):
            mine, theirs = getattr(self.controller, name), getattr(self.storage, name)
            if mine != theirs:
                raise ConfigError(
                    f"ClusterConfig: controller.{name}={mine!r} but storage.{name}={theirs!r}: a "
                    f"cluster has one {what}; set it for both with "
                    f"ClusterConfig(...).with_settings({name}=...) or the keyword {name}=",
                    setting=name,
                )
        if self.storage.port:
            raise ConfigError(
                f"ClusterConfig: storage.port={self.storage.port}: the storage units of a cluster "
                f"take free ports (a restarted one its old port); the setting port= is the "
                f"controller's",
                setting="port",
            )

    @classmethod
    def from_env(cls, **settings: Any) -> ClusterConfig:
        """The defaults, then the ``TQSTREAM_<SETTING>`` environment variables, then ``settings``
        (by name, as :meth:`with_settings` takes them)."""
        table = cluster_settings()
        env = {
            s.name: s.parse(os.environ[s.env], s.env) for s in table.values() if s.env in os.environ
        }
        for old, new in DEPRECATED.items():
            variable = f"TQSTREAM_{old.upper()}"
            if variable in os.environ:
                env[old] = table[new].parse(os.environ[variable], variable)
        return cls().with_settings(**env).with_settings(**settings)

    def with_settings(self, **settings: Any) -> ClusterConfig:
        """This configuration with settings changed by name (:func:`cluster_settings`: the keywords
        every deployment takes); None leaves a setting as it is. An old name (:data:`DEPRECATED`)
        works with a DeprecationWarning; an unknown name, an old name given with its new one and a
        refused value raise ConfigError."""
        table = cluster_settings()
        given = {name: value for name, value in settings.items() if value is not None}
        for old, new in DEPRECATED.items():
            if old not in given:
                continue
            hint = f"{new!r} (tqstream-launch {table[new].flag}, {table[new].env})"
            if new in given:
                raise ConfigError(
                    f"cluster setting {old!r} is the deprecated name of {new!r}, and both were "
                    f"given ({old}={given[old]!r}, {new}={given[new]!r}): give only {hint}",
                    setting=new,
                )
            _deprecated(
                f"cluster setting {old!r} (TQSTREAM_{old.upper()}) is deprecated and will be "
                f"removed in the next release: use {hint}"
            )
            given[new] = given.pop(old)
        for name in given:
            if name not in table:
                close = difflib.get_close_matches(name, [*table, *DEPRECATED], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"unknown cluster setting {name!r}{hint}; the settings are "
                    f"{', '.join(table)} (docs/deployment.md)",
                    setting=name,
                )
        changes: dict[str, dict[str, Any]] = {}
        for name, value in given.items():
            for path in table[name].paths:
                owner, _, field = path.rpartition(".")
                changes.setdefault(owner, {})[field] = value
        parts = {
            owner: dataclasses.replace(getattr(self, owner), **fields)
            for owner, fields in changes.items()
            if owner
        }
        return dataclasses.replace(self, **changes.get("", {}), **parts)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One cluster setting, under one name for every deployment (see the module docstring)."""

    name: str
    """The keyword (``storage_max_bytes``); the flag and the variable derive from it."""
    paths: tuple[str, ...]
    """The ClusterConfig fields it sets (``storage_units``, ``controller.replicas``,
    ``storage.max_bytes``): both components' for a field they share."""
    kind: type
    """``int``, ``float`` or ``str``."""
    default: Any
    doc: str
    """The field's docstring."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return f"TQSTREAM_{self.name.upper()}"

    def parse(self, raw: str, source: str) -> Any:
        """``raw`` (from ``source``, a variable or a flag) as a value of the setting."""
        try:
            return self.kind(raw)
        except ValueError:
            raise ConfigError(
                f"{source}={raw!r} is not a valid {self.kind.__name__} (cluster setting "
                f"{self.name!r}: {self.doc})",
                setting=self.name,
            ) from None


PER_UNIT = ("port",)
"""StorageConfig fields that no cluster setting sets: each storage unit takes its own."""


@functools.cache
def cluster_settings() -> dict[str, Setting]:
    """Every cluster setting by name, in ClusterConfig's order: its own fields, then the
    controller's, then the storage units' (named ``storage_<field>`` unless the controller has the
    field too: then one setting sets both)."""
    out: dict[str, Setting] = {}
    for top in dataclasses.fields(ClusterConfig):
        kind, _ = _kind(ClusterConfig, top.name)
        if not dataclasses.is_dataclass(kind):
            doc = _docs(ClusterConfig)[top.name]
            out[top.name] = Setting(top.name, (top.name,), kind, top.default, doc)
            continue
        for f in dataclasses.fields(kind):
            if kind is StorageConfig and f.name in PER_UNIT:
                continue
            path = f"{top.name}.{f.name}"
            shared = out.get(f.name)
            if shared is not None and shared.paths[0].startswith("controller."):
                out[f.name] = dataclasses.replace(shared, paths=(*shared.paths, path))
                continue
            name = f.name if top.name == "controller" else f"{top.name}_{f.name}"
            if name in out:  # two fields would share a flag: rename one of them
                raise TypeError(f"cluster setting {name!r} would set {out[name].paths} and {path}")
            out[name] = Setting(
                name, (path,), _kind(kind, f.name)[0], f.default, _docs(kind)[f.name]
            )
    return out


def cluster_config(config: ClusterConfig | None = None, /, **settings: Any) -> ClusterConfig:
    """The cluster a deployment starts: ``config`` as given (None: :meth:`ClusterConfig.from_env`,
    the defaults and the environment) with the keyword ``settings`` changed."""
    if config is None:
        return ClusterConfig.from_env(**settings)
    if not isinstance(config, ClusterConfig):
        raise ConfigError(
            f"config must be a tqstream.ClusterConfig, got {type(config).__name__} (a "
            f"ClientConfig configures a client: tqstream.init(client_config=...))"
        )
    return config.with_settings(**settings)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or * (every interface)
        return False


_C = TypeVar("_C")


def environment(name: str) -> str:
    """Environment variable ``name`` (one of this module's ``*_ENV``), stripped; "" if unset."""
    return os.environ.get(name, "").strip()


_NONE = object()
"""A setting the environment sets to None (``TQSTREAM_<FIELD>=none``)."""


def from_env(cls: type[_C], **overrides: Any) -> _C:
    """Build ``cls`` from defaults, then ``TQSTREAM_*`` variables, then explicit ``overrides``
    (None: not given); a ClusterConfig by its settings (:meth:`ClusterConfig.from_env`)."""
    if cls is ClusterConfig:
        return ClusterConfig.from_env(**overrides)  # type: ignore[return-value]
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = os.environ.get(f"TQSTREAM_{f.name.upper()}")
        if raw is not None and raw.strip().lower() == "none" and _kind(cls, f.name)[1]:  # type: ignore[arg-type]
            values[f.name] = _NONE
        elif raw is not None:
            kind: Any = type(f.default)
            try:
                values[f.name] = kind(raw)
            except ValueError as exc:
                raise ConfigError(
                    f"environment variable TQSTREAM_{f.name.upper()}={raw!r} is not a valid "
                    f"{kind.__name__}"
                ) from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    values = {k: None if v is _NONE else v for k, v in values.items()}
    return cls(**values)


# --- checks, field types and docs ---
_PORTS = ("port", "metrics_port")
_ARTICLED: dict[type, str] = {float: "a number", int: "an int"}


_CHOICES = {
    "shared_memory": ("auto", "off"),
    "locality": ("host", "off"),
    "durability": ("off", "batched", "sync"),
}


def _check(config: Any, component: str) -> None:
    """Refuse a value of the wrong type or out of range, naming the setting that sets it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind, optional = _kind(config.__class__, f.name)
        if value is None and optional:
            continue
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        why = "" if ok else f"must be {_ARTICLED.get(kind, 'a ' + kind.__name__)}"
        if not why and f.name == "replicas" and value not in (1, 2):
            why = "must be 1 or 2"
        elif not why and f.name == "storage_units" and value < 1:
            why = "must be at least 1"
        elif not why and f.name in _PORTS and not 0 <= value <= 65535:
            why = "must be a TCP port (0 to 65535)"
        elif not why and kind in (int, float) and not value >= 0:  # NaN too
            why = "must be >= 0"
        elif not why and f.name in _CHOICES and value not in _CHOICES[f.name]:
            why = "must be one of " + ", ".join(repr(c) for c in _CHOICES[f.name])
        if why:
            path = f"{component}.{f.name}" if component else f.name
            setting = next((s for s in cluster_settings().values() if path in s.paths), None)
            if setting is None:
                name, hint = f"{type(config).__name__}.{f.name}", ""
            else:
                name, hint = setting.name, f" (tqstream-launch {setting.flag}, {setting.env})"
            raise ConfigError(f"{name} {why}, got {value!r}{hint}", setting=name, value=value)


@functools.cache
def _kind(cls: type, name: str) -> tuple[type, bool]:
    """The type of field ``name`` of dataclass ``cls``, and whether it may also be None."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) < len(typing.get_args(hint)):
        return args[0], True
    return hint, False


@functools.cache
def _docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (its own or a base class's), so flags, errors and
    config share one text."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_docs(klass))
    return docs


def _own_docs(cls: type) -> dict[str, str]:
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _deprecated(message: str) -> None:
    """A DeprecationWarning attributed to the first caller outside tqstream: Python's default
    filters show it for the user's own code, and the line it names is theirs."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "tqstream":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
