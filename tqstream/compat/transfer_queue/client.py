"""TransferQueue 0.1.11's client (``tq.get_client()``) on a tqstream client.

Each method translates one TransferQueue call into tqstream requests: a ``global_index`` is a
tqstream row id, ``custom_meta`` are the rows' tags, a ``task_name`` is a consumer task. What
TransferQueue cannot do comes with it:

* ``get_meta(mode="fetch")`` *leases* the rows to the task (they count as consumed at once, as in
  TransferQueue), and ``get_data`` of that metadata acks them once their data is delivered: rows
  fetched by a consumer that dies before reading them go back to the task (at once when its
  process is gone, else after the lease timeout) instead of being lost.
* ``put`` to existing rows replaces the fields they have (TransferQueue's overwrite), and merges
  ``custom_meta`` into the rows' tags key by key at the same commit.
* Tensor bytes move over tqstream's zero-copy frames or shared memory, never pickled.

The async methods are the implementation; each sync twin runs its coroutine on the client's own
IO thread, as TransferQueue's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from tensordict import TensorDict

from tqstream.client.admission import AdmissionHandle
from tqstream.client.client import Client
from tqstream.client.loop import LoopThread
from tqstream.compat.transfer_queue.config import GET_TIMEOUT
from tqstream.compat.transfer_queue.data import (
    field_meta,
    from_tqstream,
    row_shapes,
    to_tqstream,
)
from tqstream.compat.transfer_queue.errors import ForeignMetadataError, KeyNotFoundError
from tqstream.compat.transfer_queue.metadata import BatchMeta
from tqstream.errors import (
    InvalidRequestError,
    RequestTimeoutError,
    UnknownFieldError,
    UnknownKeyError,
    UnknownPartitionError,
)
from tqstream.types import BatchMeta as RowsMeta
from tqstream.types import RowListing

__all__ = ["AsyncTransferQueueClient", "TransferQueueClient"]

_LEASE = "_lease"
"""Per-sample backend-meta entry of a fetched batch: ``[task, lease id]``, so whichever process
reads the batch's data acks it (the metadata travels to workers, e.g. through Ray)."""


class AsyncTransferQueueClient:
    """TransferQueue's async client API on ``client`` (a connected :class:`tqstream.Client`).

    ``polling_mode``: ``get_meta(mode="fetch")`` returns an empty ``BatchMeta`` at once when a
    full batch is not ready (else it waits up to ``get_timeout`` seconds, then TimeoutError).
    ``lease_timeout``: seconds a fetched batch stays leased without its data being read (None:
    the cluster's). ``owns``: close ``client`` with this one."""

    def __init__(
        self,
        client: Client,
        *,
        client_id: str | None = None,
        polling_mode: bool = False,
        get_timeout: float | None = None,
        lease_timeout: float | None = None,
        owns: bool = False,
    ) -> None:
        self.client = client
        self.client_id = client_id or f"TransferQueueClient_{os.getpid()}"
        self.polling_mode = polling_mode
        self.get_timeout = GET_TIMEOUT if get_timeout is None else get_timeout
        self.lease_timeout = lease_timeout
        self._owns = owns

    # --- metadata ---
    async def async_get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
        *,
        current_version: int | None = None,
        max_staleness: int | None = None,
        measure: str = "head",
        on_stale: str = "keep",
        lease_timeout: float | None = None,
    ) -> BatchMeta:
        """``insert``: ``batch_size`` new rows without data (for a ``put`` with this metadata);
        ``fetch``: the oldest ``batch_size`` rows with ``data_fields`` written that ``task_name``
        has not consumed, leased to it; ``force_fetch``: every row of the partition, consumed
        or not, nothing marked. Rows are served oldest first (TransferQueue's sequential
        sampler); ``sampling_config`` is accepted and not used.

        tqstream's staleness window (keyword-only, ``fetch``): with ``current_version`` and
        ``max_staleness`` only rows whose policy version (``measure``: "head", "tail" or
        "dispatch"; set by ``put(..., version=)`` or a per-token ``versions`` field) is at least
        ``current_version - max_staleness`` are served; ``on_stale="drop"`` evicts the older
        rows it meets (counted in the cluster's stats), "keep" leaves them. ``lease_timeout``:
        seconds this batch stays leased while its data is unread (None: the client's)."""
        fields = [data_fields] if isinstance(data_fields, str) else list(data_fields or [])
        if mode == "insert":
            if batch_size is None or batch_size < 1:
                raise InvalidRequestError(f"insert needs batch_size >= 1, got {batch_size}")
            keys = _new_keys(batch_size)
            meta = await self.client.async_put_by_keys(partition_id, keys)
            out = self._meta(meta, [0] * batch_size)
            for name in fields:  # placeholders: the put that follows fixes them
                out.field_schema.setdefault(name, field_meta(None))
            return out
        if mode == "force_fetch":
            listing = await self._listing(partition_id, fields)
            if listing is None:
                return BatchMeta.empty()
            return self._meta(listing.meta, [int(r) for r in listing.ready])
        if mode != "fetch":
            raise InvalidRequestError(
                f"mode must be 'fetch', 'insert' or 'force_fetch', got {mode!r}"
            )
        if not task_name:
            raise InvalidRequestError("get_meta(mode='fetch') needs a task_name")
        if batch_size is None:
            raise InvalidRequestError("get_meta(mode='fetch') needs a batch_size")
        timeout = 0.0 if self.polling_mode else self.get_timeout
        try:
            meta = await self.client.async_get_meta(
                partition_id, fields, batch_size, task_name,
                timeout=timeout, lease_timeout=lease_timeout or self.lease_timeout,
                current_version=current_version, max_staleness=max_staleness,
                measure=measure, on_stale=on_stale,
            )  # fmt: skip
        except (RequestTimeoutError, UnknownPartitionError, UnknownFieldError) as exc:
            if self.polling_mode:
                return BatchMeta.empty()
            if isinstance(exc, RequestTimeoutError):
                raise
            raise RequestTimeoutError(
                f"no batch of {batch_size} rows with fields {fields} for task {task_name!r} in "
                f"partition {partition_id!r} within {timeout:g}s: {exc.message}",
                partition=partition_id,
                task=task_name,
            ) from exc
        out = self._meta(meta, [1] * len(meta))
        lease = [meta.task, meta.lease_id]
        for entry in out._custom_backend_meta:
            entry[_LEASE] = lease
        return out

    async def async_kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        """The rows of ``keys``, with the fields all of them have; ``create``: keys that do not
        exist become rows without data. Without ``create``, keys that do not exist are left out."""
        names = _keys(keys)
        if create:
            meta = await self.client.async_put_by_keys(partition_id, names)
        else:
            meta = await self.client.async_lookup(partition_id, names, missing_ok=True)
        return self._meta(meta, [int(bool(meta.fields))] * len(meta))

    async def async_kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str
    ) -> list[str]:
        """The keys of rows ``global_indexes`` (rows that do not exist raise)."""
        rows = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
        if not rows:
            return []
        meta = await self.client.async_lookup(partition_id, row_ids=rows, fields=[])
        return list(meta.keys)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """Per partition, its keys in put order with their tags (``{partition: {key: tags}}``);
        a partition that does not exist is not listed."""
        try:
            listings = await self.client.async_list_rows(partition_id)
        except UnknownPartitionError:
            return {}
        return {p: _tags_by_key(listing.meta) for p, listing in listings.items()}

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        """Merge each sample's ``custom_meta`` into its row's tags."""
        for part in _by_partition(metadata):
            if part.size:
                await self.client.async_set_tags(await self._rows(part, []), part.custom_meta)

    # --- data ---
    async def async_put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
        *,
        version: int | None = None,
    ) -> BatchMeta:
        """Write ``data`` into the rows of ``metadata`` (replacing fields they have, merging its
        ``custom_meta`` into their tags), or as new rows of ``partition_id``. ``data_parser``
        runs here, before the put (it gets ``{field: values}`` and edits the values in place).
        ``version`` (keyword-only, tqstream's): the policy version that generated the rows, for
        staleness windows (a per-token ``versions`` field, -1 on prompt tokens, is read too);
        rows that have a version keep it."""
        if data_parser is not None:
            data = _parsed(data, data_parser)
        if metadata is None:
            if partition_id is None:
                raise InvalidRequestError("put needs metadata or a partition_id")
            n = data.batch_size[0] if data.batch_size else 0
            meta = await self.client.async_put(
                to_tqstream(data), partition_id, version=version, shapes=row_shapes(data) or None
            )
            return self._meta(meta, [1] * n).add_fields(data)
        if not metadata.size:
            raise InvalidRequestError("put got an empty BatchMeta: metadata cannot be empty")
        if data.batch_size and data.batch_size[0] != metadata.size:
            raise InvalidRequestError(
                f"put got {data.batch_size[0]} samples of data for a BatchMeta of "
                f"{metadata.size} samples; pass one sample per sample of the metadata"
            )
        parts = _by_partition(metadata)
        if len(parts) > 1:
            raise InvalidRequestError(
                "put takes the metadata of one partition at a time; split it with "
                "metadata.chunk_by_partition()"
            )
        rows = await self._rows(metadata, [])
        tags = [dict(t) if t else None for t in metadata.custom_meta]
        await self.client.async_put_fields(
            rows, to_tqstream(data), overwrite=True, tags=tags if any(tags) else None,
            version=version, shapes=row_shapes(data) or None,
        )  # fmt: skip
        return metadata.add_fields(data)

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        """The samples' fields (``metadata.field_names``) in metadata order; a fetched batch's
        lease is acked once its data is here."""
        if not metadata or not metadata.size or not metadata.field_names:
            return TensorDict({}, batch_size=0)
        if len(_by_partition(metadata)) > 1:
            raise InvalidRequestError(
                "get_data reads the metadata of one partition at a time; split it with "
                "metadata.chunk_by_partition()"
            )
        fields = list(metadata.field_names)
        rows = await self._rows(metadata, fields)
        td = from_tqstream(await self.client.async_get_data(rows, fields))
        await self._ack(metadata, rows)
        return td

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        for part in _by_partition(metadata):
            self._check(part)
            with contextlib.suppress(UnknownPartitionError):
                await self.client.async_clear_samples(_handle(part))

    async def async_clear_partition(self, partition_id: str) -> None:
        await self.client.async_clear_partition(partition_id)

    # --- status ---
    async def async_get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(global indexes, 1 where task_name consumed the row else 0)``; (None, None) when the
        partition does not exist."""
        listing = await self._listing(partition_id, [], task_name)
        if listing is None:
            return None, None
        ids = torch.tensor(listing.meta.row_ids, dtype=torch.int64)
        return ids, torch.tensor(listing.consumed, dtype=torch.int8)

    async def async_get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(global indexes, 1 where every field of data_fields is written else 0)``."""
        listing = await self._listing(partition_id, list(data_fields))
        if listing is None:
            return None, None
        ids = torch.tensor(listing.meta.row_ids, dtype=torch.int64)
        return ids, torch.tensor(listing.ready, dtype=torch.int8)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """Whether the partition has rows and ``task_name`` consumed every one."""
        _, consumed = await self.async_get_consumption_status(task_name, partition_id)
        return consumed is not None and consumed.numel() > 0 and bool(consumed.all())

    async def async_check_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> bool:
        """Whether the partition has rows and every one has all of ``data_fields``."""
        _, ready = await self.async_get_production_status(data_fields, partition_id)
        return ready is not None and ready.numel() > 0 and bool(ready.all())

    async def async_reset_consumption(
        self, partition_id: str, task_name: str | None = None
    ) -> bool:
        """Every row ``task_name`` (None: every task) consumed can be fetched again."""
        try:
            await self.client.async_reset_consumption(partition_id, task_name)
        except UnknownPartitionError:
            return False
        return True

    async def async_get_partition_list(self) -> list[str]:
        return list(await self.client.async_list_rows(None))

    # --- flow control ---
    def admission(self, style: str, *, name: str = "default", **config: int) -> AdmissionHandle:
        """tqstream's producer flow control, kept at the controller for every process of the job
        ("capacity": AReaL's, "slots": verl fully-async's, "per_version": JAX-vLLM's; see
        docs/staleness.md)."""
        return self.client.admission(style, name=name, **config)

    # --- lifecycle ---
    def close(self) -> None:
        if self._owns:
            self.client.close()

    # --- helpers ---
    def _meta(self, meta: RowsMeta, status: list[int]) -> BatchMeta:
        n = len(meta)
        return BatchMeta(
            global_indexes=list(meta.row_ids),
            partition_ids=[meta.partition] * n,
            field_schema={
                f: field_meta(meta.schemas.get(f), meta.shapes.get(f)) for f in meta.fields
            },
            production_status=status,
            custom_meta=[dict(t) for t in meta.tags] if meta.tags else None,
            _custom_backend_meta=[{} for _ in range(n)],
            _cluster=self.client.cluster,
            _placement=list(
                zip(meta.units, meta.replicas or [-1] * n, [meta.generation] * n, strict=True)
            ),
        )

    def _check(self, metadata: BatchMeta) -> None:
        source = metadata._cluster
        if source is not None and source != self.client.cluster:
            raise ForeignMetadataError(
                "this BatchMeta was issued by another tqstream cluster (or by this one before its "
                "controller restarted): its global indexes name no rows here; get the metadata "
                "again from this cluster (get_meta / kv_retrieve_meta)",
                cluster=source,
            )

    async def _rows(self, metadata: BatchMeta, fields: list[str]) -> RowsMeta:
        """The samples as tqstream rows: straight from the metadata when it says where they are,
        else from the controller (rows that do not exist raise ``UnknownRowError``)."""
        self._check(metadata)
        partition = metadata.partition_ids[0]
        placement = metadata._placement
        if placement is None:
            meta = await self.client.async_lookup(
                partition, row_ids=metadata.global_indexes, fields=fields
            )
            return msgspec.structs.replace(meta, fields=fields)
        return _handle(metadata, fields)

    async def _ack(self, metadata: BatchMeta, rows: RowsMeta) -> None:
        leases: dict[tuple[str, int], list[int]] = {}
        for i, entry in enumerate(metadata._custom_backend_meta):
            lease = entry.get(_LEASE) if entry else None
            if lease:
                leases.setdefault((lease[0], int(lease[1])), []).append(i)
        for (task, lease_id), positions in leases.items():
            part = msgspec.structs.replace(rows.select(positions), task=task, lease_id=lease_id)
            await self.client.async_ack(part)

    async def _listing(
        self, partition: str, fields: list[str], task: str | None = None
    ) -> RowListing | None:
        """Every row of ``partition`` (None when it does not exist) with whether ``fields`` are
        written and ``task`` consumed it; a field the partition never had is written nowhere."""
        try:
            found = await self.client.async_list_rows(partition, fields=fields, task=task)
        except UnknownPartitionError:
            return None
        except UnknownFieldError:
            listing = (await self.client.async_list_rows(partition, task=task))[partition]
            return RowListing(listing.meta, [False] * len(listing.meta), listing.consumed)
        return found[partition]


class TransferQueueClient(AsyncTransferQueueClient):
    """The sync twin: every ``async_x`` as ``x``, run to completion on an event loop of the calling
    thread's own (tqstream's client then serves it on that thread: no hand-over to another
    thread), or, called from a thread whose loop is running, on the client's IO thread."""

    def __init__(self, client: Client, **options: Any) -> None:
        super().__init__(client, **options)
        self._io = LoopThread(name="tqstream-tq-client")
        self._local = threading.local()
        self._loops: list[asyncio.AbstractEventLoop] = []  # the callers' loops, closed with us

    def _run_coroutine(self, coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            loop = getattr(self._local, "loop", None)
            if loop is None:
                loop = self._local.loop = asyncio.new_event_loop()
                self._loops.append(loop)
            return loop.run_until_complete(coro)
        return self._io.run(coro)  # inside a running loop: run_until_complete cannot nest

    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
        **window: Any,
    ) -> BatchMeta:
        return self._run_coroutine(
            self.async_get_meta(
                data_fields, batch_size, partition_id, mode, task_name, sampling_config, **window
            )
        )

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        self._run_coroutine(self.async_set_custom_meta(metadata))

    def put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
        *,
        version: int | None = None,
    ) -> BatchMeta:
        return self._run_coroutine(
            self.async_put(data, metadata, partition_id, data_parser, version=version)
        )

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        return self._run_coroutine(self.async_get_data(metadata))

    def clear_partition(self, partition_id: str) -> None:
        self._run_coroutine(self.async_clear_partition(partition_id))

    def clear_samples(self, metadata: BatchMeta) -> None:
        self._run_coroutine(self.async_clear_samples(metadata))

    def get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._run_coroutine(self.async_get_consumption_status(task_name, partition_id))

    def get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._run_coroutine(self.async_get_production_status(data_fields, partition_id))

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return self._run_coroutine(self.async_check_consumption_status(task_name, partition_id))

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return self._run_coroutine(self.async_check_production_status(data_fields, partition_id))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return self._run_coroutine(self.async_reset_consumption(partition_id, task_name))

    def get_partition_list(self) -> list[str]:
        return self._run_coroutine(self.async_get_partition_list())

    def kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        return self._run_coroutine(self.async_kv_retrieve_meta(keys, partition_id, create))

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        return self._run_coroutine(self.async_kv_retrieve_keys(global_indexes, partition_id))

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return self._run_coroutine(self.async_kv_list(partition_id))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._io.stop()
            for loop in self._loops:
                if not loop.is_running():
                    loop.close()
            self._loops.clear()


# --- helpers ---
def _new_keys(n: int) -> list[str]:
    """Keys of rows made by ``insert`` (TransferQueue's have none; tqstream's rows all have one)."""
    base = secrets.token_hex(6)
    return [f"insert-{base}-{i}" for i in range(n)]


def _keys(keys: list[str] | str) -> list[str]:
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a str or a list of str, got {type(keys).__name__}")
    if not keys:
        raise ValueError("keys is an empty list: name at least one key")
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("every key must be a str")
    return list(keys)


def _tags_by_key(meta: RowsMeta) -> dict[str, Any]:
    tags = meta.tags or [{}] * len(meta)
    return {k: dict(t) for k, t in zip(meta.keys, tags, strict=True)}


def _by_partition(metadata: BatchMeta) -> list[BatchMeta]:
    if len(set(metadata.partition_ids)) <= 1:
        return [metadata]
    return metadata.chunk_by_partition()


def _handle(metadata: BatchMeta, fields: Sequence[str] = ()) -> RowsMeta:
    """The tqstream handle of the samples' rows, built from the metadata alone."""
    n = metadata.size
    placement = metadata._placement or [(-1, -1, 0)] * n
    units = [u for u, _, _ in placement]
    replicas = [r for _, r, _ in placement]
    return RowsMeta(
        partition=metadata.partition_ids[0],
        row_ids=list(metadata.global_indexes),
        keys=[str(i) for i in metadata.global_indexes],  # named in errors only
        units=units,
        groups=[None] * n,
        version_start=[None] * n,
        version_end=[None] * n,
        fields=list(fields),
        schemas={},
        replicas=replicas if any(r >= 0 for r in replicas) else [],
        generation=placement[0][2] if placement else 0,  # one partition's: the units check it
    )


def _parsed(data: TensorDict, parser: Callable[[Any], Any]) -> TensorDict:
    """Run TransferQueue's ``data_parser`` on ``{field: values}`` (lists for nested tensors and
    non-tensor fields) and rebuild the batch from what it left there."""
    from tensordict import NonTensorStack

    plain: dict[str, Any] = {}
    for name in data.keys():  # noqa: SIM118
        value = data.get(name)
        if isinstance(value, torch.Tensor) and value.is_nested:
            plain[name] = list(value.unbind())
        elif isinstance(value, NonTensorStack):
            plain[name] = value.tolist()
        else:
            plain[name] = value
    parser(plain)
    return TensorDict(
        {k: NonTensorStack(*v) if isinstance(v, list) and v and not isinstance(v[0], torch.Tensor)
         else v for k, v in plain.items()},
        batch_size=data.batch_size,
    )  # fmt: skip


def not_found(partition: str, exc: UnknownKeyError | UnknownPartitionError) -> KeyNotFoundError:
    """TransferQueue's ``ValueError`` for keys or partitions that do not exist."""
    return KeyNotFoundError(f"keys or partition were not found: {exc.message}", partition=partition)
