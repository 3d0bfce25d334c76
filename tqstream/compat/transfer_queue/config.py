"""TransferQueue's configuration, read for a tqstream cluster.

``transfer_queue.init(conf)`` takes TransferQueue's config (a dict or an OmegaConf ``DictConfig``,
merged over the defaults below). The keys tqstream honours:

* ``backend.SimpleStorage.num_data_storage_units``: storage units to start.
* ``backend.SimpleStorage.total_storage_size``: rows the cluster holds at most (None: no cap);
  a put beyond it raises ``CapacityError``, as TransferQueue refuses it.
* ``metrics.enabled`` / ``metrics.port``: the controller's Prometheus endpoint (port 0: a free
  one); ``get_metrics_endpoint()`` returns ``host:port``.
* ``controller.polling_mode``: ``get_meta(mode="fetch")`` returns an empty batch instead of
  waiting when no full batch is ready.

tqstream's own settings go under a ``tqstream:`` section (see :class:`Settings`); every other key
(other storage backends and their settings) is kept in the returned config and not used: tqstream
stores rows in its own storage units whatever ``backend.storage_backend`` says.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ADDRESS_ENV", "DEFAULTS", "GET_TIMEOUT", "KEYS_ENV", "Settings", "merge", "settings"]

_log = logging.getLogger("tqstream.compat")

ADDRESS_ENV = "TQSTREAM_TRANSFER_QUEUE_ADDRESS"
"""The address a driver that runs the cluster in its own process hands to the processes it
starts (a bare ``init()`` there attaches to it)."""
KEYS_ENV = "TQSTREAM_KEYS"
"""The cluster's key file, for those processes (tqstream's own client setting)."""
GET_TIMEOUT = float(os.environ.get("TQ_CONTROLLER_GET_METADATA_TIMEOUT", 1))
"""Seconds a ``fetch`` waits for a full batch when not in polling mode (TransferQueue's
variable and default)."""

DEFAULTS: dict[str, Any] = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {"sampler": "SequentialSampler", "polling_mode": False},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": 2},
    },
    "tqstream": {},
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a ``transfer_queue.init`` configures in tqstream; ``tqstream.<field>`` in the config."""

    storage_units: int = 2
    """Storage units (``backend.SimpleStorage.num_data_storage_units``)."""
    max_rows: int = 0
    """Rows held at most, cluster-wide (``backend.SimpleStorage.total_storage_size``); 0: no cap."""
    metrics: bool = False
    """Serve Prometheus metrics (``metrics.enabled``)."""
    metrics_port: int = 0
    """Their port (``metrics.port``); 0: a free one."""
    polling_mode: bool = False
    """``controller.polling_mode``."""
    lease_timeout: float | None = None
    """Seconds a batch fetched with ``get_meta(mode="fetch")`` stays leased while its data is not
    read; unread, its rows go back to the task (None: tqstream's default, 300)."""
    get_timeout: float | None = None
    """Seconds a ``fetch`` outside polling mode waits for a full batch (None: TransferQueue's
    ``TQ_CONTROLLER_GET_METADATA_TIMEOUT``, 1)."""
    put_timeout: float | None = None
    """Seconds an uncommitted put may stay in flight before it is rolled back."""
    storage_max_bytes: int | None = None
    """Byte quota of each storage unit (None/0: unlimited)."""
    replicas: int | None = None
    """Copies of each row (2 survives the loss of a storage unit)."""
    keys: str | None = None
    """The cluster's CURVE key file (made if missing): every socket authenticated."""
    num_cpus: float = 0.0
    """Logical CPUs each Ray actor of the cluster reserves."""
    deployment: str = "auto"
    """``auto``: Ray actors when Ray is initialised, else in this process; ``ray``; ``embedded``."""


def merge(conf: Any) -> dict[str, Any]:
    """``conf`` (None, a mapping or a DictConfig) merged over :data:`DEFAULTS`, as plain dicts."""
    out = copy.deepcopy(DEFAULTS)
    if conf is None:
        return out
    plain = _plain(conf)
    if not isinstance(plain, Mapping):
        raise TypeError(
            f"transfer_queue.init takes a dict or DictConfig, got {type(conf).__name__}"
        )
    _merge_into(out, plain)
    return out


def settings(conf: Mapping[str, Any]) -> Settings:
    """The tqstream settings of a merged config (see the module docstring)."""
    backend = conf.get("backend") or {}
    name = backend.get("storage_backend", "SimpleStorage")
    if name != "SimpleStorage":
        _log.warning(
            "transfer_queue backend %r is not used: tqstream stores rows in its own storage "
            "units (SimpleStorage's settings apply)",
            name,
        )
    simple = backend.get("SimpleStorage") or {}
    metrics = conf.get("metrics") or {}
    controller = conf.get("controller") or {}
    sampler = controller.get("sampler", "SequentialSampler")
    if sampler not in (None, "SequentialSampler"):
        raise ValueError(
            f"controller.sampler={sampler!r}: tqstream serves a task's ready rows oldest first "
            f"(TransferQueue's SequentialSampler); other samplers are not supported"
        )
    own = dict(conf.get("tqstream") or {})
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(own) - known)
    if unknown:
        raise ValueError(
            f"unknown tqstream setting(s) {unknown} in the transfer_queue config; known: "
            f"{sorted(known)}"
        )
    base = {
        "storage_units": int(simple.get("num_data_storage_units") or 1),
        "max_rows": int(simple.get("total_storage_size") or 0),
        "metrics": bool(metrics.get("enabled", False)),
        "metrics_port": int(metrics.get("port") or 0),
        "polling_mode": bool(controller.get("polling_mode", False)),
    }
    result = Settings(**{**base, **own})
    if result.deployment not in ("auto", "ray", "embedded"):
        raise ValueError(
            f"tqstream.deployment must be 'auto', 'ray' or 'embedded', got {result.deployment!r}"
        )
    if result.storage_units < 1:
        raise ValueError(
            f"backend.SimpleStorage.num_data_storage_units must be >= 1, got {result.storage_units}"
        )
    return result


def _plain(conf: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with hydra / verl
        return conf
    if isinstance(conf, DictConfig):
        return OmegaConf.to_container(conf, resolve=True)
    return conf


def _merge_into(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge_into(base[key], value)
        else:
            base[key] = copy.deepcopy(value) if isinstance(value, (dict, list)) else value
