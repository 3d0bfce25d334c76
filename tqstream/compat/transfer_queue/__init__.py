"""TransferQueue 0.1.11's public API on tqstream: ``import transfer_queue as tq`` in verl 0.9.1's
trainer, its agent-loop workers and its ``tqbridge``-wrapped worker methods, or in NeMo-RL's
TransferQueue adapter, runs on a tqstream cluster.

Import it directly (``import tqstream.compat.transfer_queue as tq``), or turn on the switch
(``TQSTREAM_TRANSFER_QUEUE=1``) that makes ``import transfer_queue`` resolve to this package in
every process of the job (docs/migrating.md). What behaves differently from TransferQueue, and
what tqstream adds (leases, tags merged at the controller, no pickle on the wire), is in
docs/migrating.md.
"""

from __future__ import annotations

from tqstream.compat.transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient
from tqstream.compat.transfer_queue.errors import StorageKeyNotFoundError
from tqstream.compat.transfer_queue.interface import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    close,
    get_client,
    get_metrics_endpoint,
    init,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    load_checkpoint,
    save_checkpoint,
)
from tqstream.compat.transfer_queue.metadata import BatchMeta, KVBatchMeta

__version__ = "0.1.11"
"""The TransferQueue version whose API this is."""

__all__ = [
    "AsyncTransferQueueClient",
    "BatchMeta",
    "KVBatchMeta",
    "StorageKeyNotFoundError",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
]
