"""tqstream: the experience data plane for asynchronous RL post-training.

``import tqstream`` is cheap: it loads the exception tree and nothing else; torch, tensordict, ZMQ
and the servers load on first use of a name that needs them (and Ray, vLLM or framework adapters
only when those integrations are used).

    client = tqstream.init()                      # embedded controller + storage unit
    client = tqstream.connect("tcp://HOST:PORT")  # a cluster started by tqstream-launch
    client = tqstream.default_client()            # the process's: $TQSTREAM_ADDRESS, else embedded
"""

from __future__ import annotations

import importlib
from typing import Any

from tqstream.errors import *  # noqa: F403
from tqstream.errors import __all__ as _errors_all

__version__ = "0.1.0"

_LAZY = {
    "Batch": "tqstream.client.client",
    "BatchMeta": "tqstream.types",
    "CheckpointSummary": "tqstream.types",
    "Client": "tqstream.client.client",
    "Column": "tqstream.protocol.columns",
    "ClientConfig": "tqstream.config",
    "ClusterConfig": "tqstream.config",
    "ControllerConfig": "tqstream.config",
    "Experience": "tqstream.experience",
    "ExperienceBatch": "tqstream.experience",
    "FieldSchema": "tqstream.types",
    "PartitionStats": "tqstream.types",
    "RowShapes": "tqstream.types",
    "ProcessCluster": "tqstream.launch.processes",
    "StalenessPolicy": "tqstream.staleness",
    "Stats": "tqstream.types",
    "StorageConfig": "tqstream.config",
    "TaskStats": "tqstream.types",
    "UnitStats": "tqstream.types",
    "connect": "tqstream.client.client",
    "default_client": "tqstream.launch.default",
    "generate_keys": "tqstream.protocol.auth",
    "init": "tqstream.launch.embedded",
}

__all__ = sorted([*_LAZY, *_errors_all, "__version__"])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tqstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
