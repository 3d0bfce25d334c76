"""Configuration: one frozen dataclass per component, every field with a default and a docstring.

Environment variables are read here and nowhere else (``TQSTREAM_<FIELD>`` in upper case, e.g.
``TQSTREAM_LEASE_TIMEOUT=60``); explicit arguments win over the environment. The ``tqstream-launch``
flags are generated from these dataclasses.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

__all__ = [
    "ADDRESS_ENV",
    "AREAL_BUDGET_ENV",
    "ClientConfig",
    "ControllerConfig",
    "StorageConfig",
    "environment",
    "from_env",
]

ADDRESS_ENV = "TQSTREAM_ADDRESS"
"""The cluster a process uses when it is given no client (``tqstream/launch/default.py``): a
``tcp://HOST:PORT`` address (its key file, if any, in ``TQSTREAM_KEYS``); unset: the process
starts its own embedded cluster."""
AREAL_BUDGET_ENV = "TQSTREAM_AREAL_BUDGET"
"""The budget that AReaL ``StalenessManager`` s built without a name share (set it for every
rank: ``docs/adapters/areal.md``); unset: each keeps a budget of its own."""

GiB = 1 << 30
DEFAULT_MAX_MESSAGE_BYTES = 2 * GiB


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    host: str = "127.0.0.1"
    """Interface to bind; loopback by default."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    lease_timeout: float = 300.0
    """Seconds a leased batch stays leased without ack before its rows become available again."""
    put_timeout: float = 60.0
    """Seconds a prepared put may stay uncommitted before it is aborted and its storage freed."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted; larger ones get a MessageTooLargeError reply."""
    storage_timeout: float = 30.0
    """Seconds to wait for a storage unit to answer a drop or stats request."""
    replicas: int = 1
    """Copies kept of each row, on distinct storage units (1 or 2); a partition can set its own
    (``create_partition(..., replicas=2)``). With 2, losing one unit loses no row."""
    keys: str = ""
    """Path of the cluster's CURVE key file (``tqstream-launch --keys``): TCP peers must hold its
    client keypair; empty: no authentication, any peer that reaches the port is served."""
    metrics_port: int = 0
    """Port of the Prometheus metrics endpoint (``http://HOST:PORT/metrics`` on the controller's
    host); 0: no endpoint (docs/observability.md)."""
    max_rows: int = 0
    """Rows the cluster holds at most, over every partition (rows being put included); a put or
    keyed write that would exceed it raises CapacityError. 0: no cap."""


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    host: str = "127.0.0.1"
    """Interface to bind; loopback by default."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted; larger ones get a MessageTooLargeError reply."""
    max_bytes: int = 0
    """Byte quota of the unit (0: unlimited); puts wait for room, then raise CapacityError."""
    keys: str = ""
    """Path of the cluster's CURVE key file (``tqstream-launch --keys``): TCP peers must hold its
    client keypair; empty: no authentication, any peer that reaches the port is served."""


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
    direct_put_bytes: int = 1 << 20
    """Puts of fewer bytes that go as frames (see ``shared_memory_min_bytes``) go to one storage
    unit in one exchange (units in turn; the unit has the controller commit them); other puts are
    placed by the controller first (spread over units by load). 0: every put is placed first."""
    keys: str = ""
    """Path of the cluster's CURVE key file (the one ``tqstream-launch --keys`` names), needed to
    reach a cluster started with keys; empty: connect without (docs/security.md)."""


_C = TypeVar("_C")


def environment(name: str) -> str:
    """Environment variable ``name`` (one of this module's ``*_ENV``), stripped; "" if unset."""
    return os.environ.get(name, "").strip()


def from_env(cls: type[_C], **overrides: Any) -> _C:
    """Build ``cls`` from defaults, then ``TQSTREAM_*`` variables, then explicit ``overrides``."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = os.environ.get(f"TQSTREAM_{f.name.upper()}")
        if raw is not None:
            kind: Any = type(f.default)
            try:
                values[f.name] = kind(raw)
            except ValueError as exc:
                raise ValueError(
                    f"environment variable TQSTREAM_{f.name.upper()}={raw!r} is not a valid "
                    f"{kind.__name__}"
                ) from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)
