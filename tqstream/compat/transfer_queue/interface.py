"""TransferQueue 0.1.11's module-level API (``import transfer_queue as tq; tq.init(); tq.kv_put``)
on a tqstream cluster.

One cluster per job: the driver's ``init(conf)`` starts it (see ``deploy.py``), a bare ``init()``
in any other process attaches to it, and each process keeps one client. The KV functions map onto
tqstream's keyed writes and reads, one controller round trip for the metadata and the data moved
directly to and from the storage units:

* ``kv_batch_put`` writes fields and tags by key in one atomic write: keys that do not exist become
  rows, fields the rows have are replaced, tags are merged key by key at the controller (a later
  ``{"status": ...}`` keeps ``is_prompt``), so concurrent writers never lose each other's tags;
* ``kv_batch_get`` returns the rows in key order, ragged fields as jagged nested tensors, and
  refuses keys or partitions that do not exist (``ValueError``) instead of leaving them out;
* ``kv_list`` lists keys with their tags, ``kv_clear`` frees rows (keys that do not exist are
  ignored), ``save_checkpoint`` / ``load_checkpoint`` are tqstream's (data, keys and tags).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from tqstream.compat.transfer_queue.client import TransferQueueClient, not_found
from tqstream.compat.transfer_queue.config import merge, settings
from tqstream.compat.transfer_queue.data import (
    batch_size_of,
    from_tqstream,
    row_shapes,
    to_tqstream,
)
from tqstream.compat.transfer_queue.deploy import Found, Started, find, start
from tqstream.compat.transfer_queue.errors import NotInitializedError
from tqstream.compat.transfer_queue.metadata import KVBatchMeta
from tqstream.errors import (
    CheckpointNotFoundError,
    NotReadyError,
    UnknownKeyError,
    UnknownPartitionError,
)

__all__ = [
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

_log = logging.getLogger("tqstream.compat")

_lock = threading.RLock()
_client: TransferQueueClient | None = None
_started: Started | None = None
_conf: dict[str, Any] = {}
_pid = os.getpid()


# --- lifecycle ---
def init(conf: Any = None) -> Any:
    """Attach this process to the job's cluster, starting it when there is none (then ``conf``,
    TransferQueue's config as a dict or DictConfig, configures it; see ``config.py``). Returns the
    merged config (a DictConfig when omegaconf is installed); attaching returns ``conf``."""
    global _client, _started, _conf, _pid
    with _lock:
        if _client is not None and _pid == os.getpid():
            return conf
        _client = _started = None  # a forked child starts afresh
        wanted = settings(merge(conf)).deployment if conf is not None else "auto"
        found = find(use_ray=wanted != "embedded")
        if found is None:
            merged = merge(conf)
            try:
                found = _started = start(settings(merged), merged)
            except ValueError as exc:  # another process of the job started it meanwhile
                found = find()
                if found is None:
                    raise
                _log.info("transfer_queue: attaching to the cluster another process started (%s)",
                          exc)  # fmt: skip
        merged = found.conf or merge(conf if _started is None else None)
        _client = _connect(found, merged)
        _conf, _pid = merged, os.getpid()
        return _dictconfig(merged) if _started is not None else conf


def _connect(found: Found, merged: dict[str, Any]) -> TransferQueueClient:
    import tqstream

    s = settings(merged)
    owned = found.client if isinstance(found, Started) else None
    tqs = owned or tqstream.connect(found.address, found.client_config())
    return TransferQueueClient(
        tqs,
        polling_mode=s.polling_mode,
        get_timeout=s.get_timeout,
        lease_timeout=s.lease_timeout,
        owns=owned is None,
    )


def close() -> None:
    """Close this process's client; in the process that started the cluster, stop it too."""
    global _client, _started
    with _lock:
        client, started = _client, _started
        _client = _started = None
        try:
            if client is not None and _pid == os.getpid():
                client.close()
        finally:
            if started is not None and _pid == os.getpid():
                started.stop()


def get_client() -> TransferQueueClient:
    """This process's TransferQueue client (attaching to the job's cluster if needed)."""
    with _lock:
        if _client is not None and _pid == os.getpid():
            return _client
        if find() is None:
            raise NotInitializedError(
                "TransferQueue is not initialized: call transfer_queue.init() first (the driver "
                "with its config starts the cluster, other processes attach with a bare init())"
            )
        init()
        assert _client is not None
        return _client


def get_metrics_endpoint() -> str | None:
    """``host:port`` of the cluster's Prometheus endpoint, or None when metrics are off."""
    with _lock:
        if _client is None and find() is not None:
            init()
        return (_conf.get("metrics") or {}).get("endpoint")


def _dictconfig(conf: dict[str, Any]) -> Any:
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with hydra / verl
        return conf
    return OmegaConf.create(conf, flags={"allow_objects": True})


# --- checkpoints ---
def save_checkpoint(
    checkpoint_dir: str | Path,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Save every partition's rows, keys, tags and consumption to ``checkpoint_dir``, atomically
    (tqstream's checkpoint; ``include_storage`` is always true: the data is in memory). The
    directory also gets TransferQueue's ``metadata.json`` (``storage_saved``, ``user_metadata``)."""
    get_client().client.save_checkpoint(checkpoint_dir, metadata=metadata)
    info = {"storage_saved": True, "user_metadata": dict(metadata or {})}
    (Path(checkpoint_dir) / "metadata.json").write_text(json.dumps(info, indent=2))


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Restore a checkpoint into the cluster (which must hold no rows); ``FileNotFoundError``
    when there is none at ``checkpoint_dir``."""
    client = get_client()
    path = Path(checkpoint_dir)
    if path.is_dir() and not (path / "metadata.json").exists():
        raise CheckpointNotFoundError(
            f"metadata.json not found in {path}: not a checkpoint written by "
            f"transfer_queue.save_checkpoint (a tqstream checkpoint loads with "
            f"tqstream.Client.load_checkpoint)",
            path=str(path),
        )
    client.client.load_checkpoint(path)


# --- KV ---
async def async_kv_put(
    key: str,
    partition_id: str,
    fields: TensorDict | dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
    *,
    version: int | None = None,
) -> KVBatchMeta:
    """``kv_batch_put`` of one key; a dict's tensors get their batch dimension added."""
    if fields is None and tag is None:
        raise ValueError("kv_put needs fields or a tag (or both)")
    batch = None if fields is None else _one_row(fields)
    tags = None if tag is None else [tag]
    return await async_kv_batch_put([key], partition_id, batch, tags, data_parser, version=version)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
    *,
    version: int | None = None,
) -> KVBatchMeta:
    """Write ``fields`` (one sample per key) and merge ``tags`` into the rows of ``keys``, creating
    the rows that do not exist; returns the keys, their tags and every field they all have.
    ``version`` (keyword-only, tqstream's): the rows' policy version for staleness windows (a
    per-token ``versions`` field is read too), set on rows that have none."""
    if fields is None and tags is None:
        raise ValueError("kv_batch_put needs fields or tags (or both)")
    if fields is not None and batch_size_of(fields) != len(keys):
        raise ValueError(
            f"`keys` has {len(keys)} entries but `fields` has batch_size {batch_size_of(fields)}; "
            f"pass one sample per key"
        )
    if tags is not None and len(tags) != len(keys):
        raise ValueError(f"`keys` has {len(keys)} entries but `tags` has {len(tags)}")
    client = get_client()
    data = shapes = None
    if fields is not None:
        if data_parser is not None:
            from tqstream.compat.transfer_queue.client import _parsed

            fields = _parsed(fields, data_parser)
        data, shapes = to_tqstream(fields), row_shapes(fields) or None
    meta = await client.client.async_put_by_keys(
        partition_id, keys, data, tags=tags, version=version, shapes=shapes
    )
    tags_now: list[dict[str, Any]] = list(meta.tags) if meta.tags else [{} for _ in keys]
    return KVBatchMeta._issued(list(meta.keys), tags_now, partition_id, sorted(meta.fields))


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> TensorDict:
    """The rows of ``keys`` in that order: ``select_fields`` (None: every field all of them have);
    ``ValueError`` when a key, the partition or a field of some row is missing."""
    names = [keys] if isinstance(keys, str) else list(keys)
    fields = [select_fields] if isinstance(select_fields, str) else select_fields
    tqs = get_client().client
    try:
        meta = await tqs.async_lookup(partition_id, names, fields=fields)
    except (UnknownKeyError, UnknownPartitionError) as exc:
        raise not_found(partition_id, exc) from None
    except NotReadyError as exc:
        raise ValueError(f"Some fields are not ready in all the requested keys: {exc}") from None
    if not meta.fields:
        raise ValueError(
            f"the {len(names)} keys of partition {partition_id!r} have no field in common to read"
        )
    return from_tqstream(await tqs.async_get_data(meta))


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> TensorDict:
    """``kv_batch_get`` of a ``KVBatchMeta``'s keys: its fields, or ``select_fields`` of them."""
    if meta.partition_id is None:
        raise ValueError("the KVBatchMeta has no partition_id")
    fields = [select_fields] if isinstance(select_fields, str) else select_fields
    if fields is not None:
        unknown = [f for f in fields if meta.fields is None or f not in meta.fields]
        if unknown:
            raise ValueError(
                f"select_fields {unknown} not found in the KVBatchMeta's fields {meta.fields}"
            )
    else:
        fields = meta.fields
    return await async_kv_batch_get(meta.keys, meta.partition_id, fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tags}}`` of one partition or all of them."""
    return await get_client().async_kv_list(partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Delete the rows of ``keys`` and free their data; keys that do not exist are ignored."""
    names = [keys] if isinstance(keys, str) else list(keys)
    tqs = get_client().client
    meta = await tqs.async_lookup(partition_id, names, fields=[], missing_ok=True)
    if len(meta):
        await tqs.async_clear_samples(meta)


def _one_row(fields: TensorDict | dict[str, Any]) -> TensorDict:
    if isinstance(fields, TensorDict):
        return fields
    if not isinstance(fields, dict):
        raise ValueError("`fields` must be a dict or a TensorDict")
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ValueError(
                    f"field {name!r} is a nested tensor: use kv_batch_put for several samples"
                )
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = NonTensorStack(value)
    return TensorDict(batch, batch_size=[1])


# --- sync twins ---
def _run(fn: Callable[..., Any], *args: Any) -> Any:
    client = get_client()  # before the coroutine exists: an error leaves none unawaited
    return client._run_coroutine(fn(*args))


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDict | dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
    *,
    version: int | None = None,
) -> KVBatchMeta:
    client = get_client()
    return client._run_coroutine(
        async_kv_put(key, partition_id, fields, tag, data_parser, version=version)
    )


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
    *,
    version: int | None = None,
) -> KVBatchMeta:
    client = get_client()
    return client._run_coroutine(
        async_kv_batch_put(keys, partition_id, fields, tags, data_parser, version=version)
    )


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> TensorDict:
    return _run(async_kv_batch_get, keys, partition_id, select_fields)


def kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> TensorDict:
    return _run(async_kv_batch_get_by_meta, meta, select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return _run(async_kv_list, partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    _run(async_kv_clear, keys, partition_id)
