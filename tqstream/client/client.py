"""The public client: every operation as a coroutine ``async_x`` and a blocking twin ``x``.

Encoding a batch into columns and decoding fetched columns into a TensorDict run in the caller's
thread; only socket I/O runs on the client's IO thread, so a large put or get does not stall other
requests in flight on the same client. (Small puts a coalescing client merges are encoded together
where they are sent, once for all of them: ``deferred.py``.) The client is thread-safe and may be
used from several threads and event loops at once. After ``os.fork`` a client cannot be used in
the child (its IO thread does not exist there): create a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqstream.client.admission import AdmissionHandle
from tqstream.client.batch import Batch
from tqstream.client.core import ClientCore
from tqstream.client.deferred import Signatures
from tqstream.client.lanes import CLOSED, Lanes
from tqstream.client.loop import LoopThread
from tqstream.client.requests import (
    PadValues,
    checkpoint_message,
    decode,
    encode_fields,
    encode_put,
    fields_request,
    get_request,
    keyed_columns,
    partition_message,
    read_window,
    reply_wait,
    tags_message,
    upsert_message,
    with_fresh_mask,
)
from tqstream.config import ClientConfig, from_env
from tqstream.convert.tensordict import to_tensordict
from tqstream.errors import ClosedError
from tqstream.protocol.columns import Column
from tqstream.protocol.messages import (
    CheckpointReply,
    ClosePartition,
    CreateAdmission,
    ListRows,
    LoadCheckpoint,
    MetaReply,
    ResetConsumption,
    RowsReply,
    SaveCheckpoint,
)
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta, CheckpointSummary, RowListing, RowShapes, Stats, check_style

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["Batch", "Client", "connect"]


class Client:
    """A connection to a tqstream controller and its storage units.

    Create one with :func:`tqstream.init` (embedded controller and storage unit) or
    :func:`tqstream.connect` (a cluster started by ``tqstream-launch``). ``io``, ``context`` and
    ``inproc_address`` are how an embedded cluster lends its client its loop thread, ZMQ context
    and ``inproc://`` endpoint; ``address`` stays the TCP address other processes connect to.
    """

    def __init__(
        self,
        address: str,
        config: ClientConfig | None = None,
        *,
        on_close: Callable[[], None] | None = None,
        io: LoopThread | None = None,
        context: Any = None,
        inproc_address: str | None = None,
    ) -> None:
        self.address = address
        self.config = config or from_env(ClientConfig)
        self._pid = os.getpid()
        self._owns_io = io is None
        self._io = io or LoopThread(name="tqstream-client-io")
        self._closed = False
        self._on_close = on_close
        # of the puts this client encoded (deferred.py)
        self._signatures = Signatures(self.config.direct_put_bytes)
        # every connection of this client (its IO thread's and its lanes') names the same session:
        # the controller gives back what the client held only when all of them are gone
        session = secrets.token_bytes(16)
        try:
            self._core = self._io.run(
                ClientCore.open(inproc_address or address, self.config, context, session)
            )
        except BaseException:
            if self._owns_io:
                self._io.stop()
            if on_close is not None:
                on_close()
            raise
        # calls of a client of other processes run on the caller's thread or loop (lanes.py)
        release = functools.partial(_release_on, self._io, self._core)  # no reference to self
        lanes = self.config
        if self._core.controller.welcome.durable:  # a lane opened while it restarts waits for it
            wait = max(lanes.connect_timeout, lanes.reconnect_timeout)
            lanes = dataclasses.replace(lanes, connect_timeout=wait)
        cluster = self._core.controller.welcome.cluster  # every lane must reach the same
        self._lanes = (
            Lanes(address, lanes, release, self._io.loop, session, cluster) if io is None else None
        )
        self._finalizer = weakref.finalize(
            self, _finalize, self._io if self._owns_io else None, self._core, on_close,
            None, self._lanes,
        )  # fmt: skip

    # --- lifecycle ---
    def close(self) -> None:
        """Close the sockets (and, for an embedded client, stop its servers). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _finalize(
            self._io if self._owns_io else None, self._core, self._on_close, self._io, self._lanes
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def cluster(self) -> str:
        """A token of the cluster this client talks to, new each time its controller starts:
        metadata that names another token was not issued by this cluster."""
        return self._core.controller.welcome.cluster

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(CLOSED)
        if os.getpid() != self._pid:
            raise ClosedError(
                "this tqstream client was created in another process (before a "
                "fork); create a new client in this process"
            )

    def _sync(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(core, *args)`` (a ``ClientCore`` coroutine function) on this thread's lane
        when the client has lanes, else on the IO thread."""
        self._check()
        lanes = self._lanes
        if lanes is not None and (lane := lanes.enter()) is not None:
            try:
                return lane.run(method(lane.core, *args))
            finally:
                lanes.leave(lane)
        return self._io.run(method(self._core, *args))

    async def _async(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(core, *args)`` on the running loop's lane when the client has lanes, else on
        the IO thread."""
        self._check()
        core = None if self._lanes is None else await self._lanes.core()
        if core is None:
            return await self._io.arun(method(self._core, *args))
        return await method(core, *args)

    # --- put ---
    def put(
        self,
        data: Any,
        partition: str,
        *,
        keys: Sequence[str] | None = None,
        groups: Sequence[Any] | None = None,
        group_size: int | None = None,
        version: int | None = None,
        dispatch_version: int | Sequence[int | None] | None = None,
        versions_field: str | None = "versions",
        reject_mixed_versions: bool = False,
        timeout: float | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        shapes: Mapping[str, RowShapes] | None = None,
    ) -> BatchMeta:
        """Store ``data`` (TensorDict or dict of tensors / lists, B rows) as B new rows.

        ``keys``: unique per partition, generated when absent. ``groups``: a group id per row
        (e.g. the GRPO prompt uid); a group's size is ``group_size`` or, when absent, its row count
        in this put. ``version``: the policy version the rows were generated under; when the data
        has a per-token ``versions_field`` (-1 on prompt tokens), each row's ``version_start`` /
        ``version_end`` are its oldest / newest generated token's version instead.
        ``dispatch_version``: the version when generation was requested (int or one per row).
        ``reject_mixed_versions``: refuse (and count) rows whose tokens span several versions.
        ``timeout``: how long to wait for room when storage units have byte quotas (None:
        forever), then ``CapacityError``. ``tags``: per row, a small mapping of str to scalars
        the controller keeps with the row (see ``put_by_keys``). ``shapes``: per tensor field,
        its rows' shapes as TransferQueue's metadata reports them (``RowShapes``; the
        TransferQueue compatibility layer sends them, ``BatchMeta.shapes`` returns them). The rows
        become visible to readers all at once, when every byte is stored.
        """
        window = self.config.coalesce_window
        req, columns = encode_put(
            data, partition, keys, groups, group_size, version, dispatch_version,
            versions_field, reject_mixed_versions, timeout, tags,
            self._signatures if window else None, shapes,
        )  # fmt: skip
        if window:  # puts of several threads meet on the IO thread
            self._check()
            caller = threading.current_thread()
            return self._io.run(ClientCore.put(self._core, req, columns, True, caller))
        return self._sync(ClientCore.put, req, columns, False)  # a thread waits for each

    async def async_put(
        self,
        data: Any,
        partition: str,
        *,
        keys: Sequence[str] | None = None,
        groups: Sequence[Any] | None = None,
        group_size: int | None = None,
        version: int | None = None,
        dispatch_version: int | Sequence[int | None] | None = None,
        versions_field: str | None = "versions",
        reject_mixed_versions: bool = False,
        timeout: float | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        shapes: Mapping[str, RowShapes] | None = None,
    ) -> BatchMeta:
        coalescing = self.config.coalesce_window is not None
        req, columns = encode_put(
            data, partition, keys, groups, group_size, version, dispatch_version,
            versions_field, reject_mixed_versions, timeout, tags,
            self._signatures if coalescing else None, shapes,
        )  # fmt: skip
        return await self._async(ClientCore.put, req, columns, True, asyncio.current_task())

    def put_fields(
        self,
        meta: BatchMeta,
        data: Any,
        *,
        overwrite: bool = False,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        version: int | None = None,
        versions_field: str | None = "versions",
        shapes: Mapping[str, RowShapes] | None = None,
    ) -> None:
        """Add columns (e.g. ``advantages``) to existing rows, in ``meta``'s row order.

        A field a row has already is refused (``FieldExistsError``) unless ``overwrite=True``:
        the new values then replace the old ones, which readers stop seeing at the commit (views
        already read stay valid). ``tags``: per row, merged into the row's tags at the commit.
        ``version`` / ``versions_field``: policy versions for rows that have none yet.
        ``shapes``: as for ``put``."""
        columns = encode_fields(meta, data)
        req = fields_request(
            meta.partition, columns, row_ids=meta.row_ids, tags=tags, overwrite=overwrite,
            version=version, versions_field=versions_field, shapes=shapes,
        )  # fmt: skip
        self._sync(ClientCore.write_fields, req, columns)

    async def async_put_fields(
        self,
        meta: BatchMeta,
        data: Any,
        *,
        overwrite: bool = False,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        version: int | None = None,
        versions_field: str | None = "versions",
        shapes: Mapping[str, RowShapes] | None = None,
    ) -> None:
        columns = encode_fields(meta, data)
        req = fields_request(
            meta.partition, columns, row_ids=meta.row_ids, tags=tags, overwrite=overwrite,
            version=version, versions_field=versions_field, shapes=shapes,
        )  # fmt: skip
        await self._async(ClientCore.write_fields, req, columns)

    def put_by_keys(
        self,
        partition: str,
        keys: Sequence[str],
        data: Any = None,
        *,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        create: bool = True,
        overwrite: bool = True,
        version: int | None = None,
        versions_field: str | None = "versions",
        shapes: Mapping[str, RowShapes] | None = None,
    ) -> BatchMeta:
        """Write fields and/or tags of the rows of ``keys`` (one row of ``data`` and one entry of
        ``tags`` per key, in order): a key-value write.

        Keys not in the partition become new rows (``create=False``: ``UnknownKeyError``), stored
        on a unit like a put's rows and visible when the write commits. Fields a row has already
        are replaced (``overwrite=False``: ``FieldExistsError``). ``tags`` (per row a mapping of
        str to a scalar or a flat list of scalars, or None) are merged into the row's tags key by
        key. With ``data=None`` only the tags are written (rows without fields may be created:
        their fields can follow). ``version`` / ``versions_field``: the rows' policy versions, as
        for ``put``, set on the rows that have none yet (created by this write, or without
        fields until now). Returns the rows' metadata, ``fields`` being the fields every one of
        them has now; nothing is written on error. ``shapes``: as for ``put``."""
        if data is None:
            return self._sync(ClientCore.call, upsert_message(partition, keys, tags, create),
                              MetaReply).batch()  # fmt: skip
        names, columns = keyed_columns(keys, data)
        req = fields_request(
            partition, columns, keys=names, tags=tags, create=create, overwrite=overwrite,
            version=version, versions_field=versions_field, shapes=shapes,
        )  # fmt: skip
        return self._sync(ClientCore.write_fields, req, columns)

    async def async_put_by_keys(
        self,
        partition: str,
        keys: Sequence[str],
        data: Any = None,
        *,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        create: bool = True,
        overwrite: bool = True,
        version: int | None = None,
        versions_field: str | None = "versions",
        shapes: Mapping[str, RowShapes] | None = None,
    ) -> BatchMeta:
        if data is None:
            msg = upsert_message(partition, keys, tags, create)
            return (await self._async(ClientCore.call, msg, MetaReply)).batch()
        names, columns = keyed_columns(keys, data)
        req = fields_request(
            partition, columns, keys=names, tags=tags, create=create, overwrite=overwrite,
            version=version, versions_field=versions_field, shapes=shapes,
        )  # fmt: skip
        return await self._async(ClientCore.write_fields, req, columns)

    def create_partition(
        self,
        partition: str,
        fields: Sequence[str] = (),
        *,
        tasks: Sequence[str] | None = None,
        ttl: float | None = None,
        admission: str | None = None,
        producers: int | None = None,
        replicas: int | None = None,
    ) -> None:
        """Create ``partition`` and declare ``fields``, so gets wait for them instead of failing.

        ``tasks``: register the consumer tasks; a row is freed (storage released) as soon as all
        of them acked it. ``ttl``: seconds a committed row lives before it is evicted (counted in
        stats as expired). ``admission``: the name of the capacity admission whose producers feed
        this partition; rows evicted as stale give their budget back to it (one slot per row:
        link only when producers take one slot per row), so the trainer is never starved by
        samples it could not use. ``producers``: how many ``close_partition`` calls close it
        (default 1). ``replicas``: 2 stores every row on two storage units, so losing one unit
        loses no row (default: the controller's ``replicas``, 1 unless configured); set it before
        the first put. Calling it again adds fields and updates the other settings.
        """
        msg = partition_message(partition, fields, tasks, ttl, admission, producers, replicas)
        self._sync(ClientCore.call, msg)

    async def async_create_partition(
        self,
        partition: str,
        fields: Sequence[str] = (),
        *,
        tasks: Sequence[str] | None = None,
        ttl: float | None = None,
        admission: str | None = None,
        producers: int | None = None,
        replicas: int | None = None,
    ) -> None:
        msg = partition_message(partition, fields, tasks, ttl, admission, producers, replicas)
        await self._async(ClientCore.call, msg)

    def close_partition(self, partition: str) -> int:
        """One producer is done with ``partition``; returns how many declared producers have not
        closed it yet. Once none has, it takes no new rows (``PartitionClosedError``) and a get
        that cannot be filled any more returns the last, short batch, then raises
        ``PartitionDrainedError``: the end of a finite stream."""
        return self._sync(ClientCore.call, ClosePartition(rid=0, partition=partition)).count

    async def async_close_partition(self, partition: str) -> int:
        msg = ClosePartition(rid=0, partition=partition)
        return (await self._async(ClientCore.call, msg)).count

    # --- get ---
    def get_meta(
        self,
        partition: str,
        fields: Sequence[str] | str,
        batch_size: int,
        task: str,
        *,
        whole_groups: bool = False,
        lease_timeout: float | None = None,
        timeout: float | None = None,
        current_version: int | None = None,
        max_staleness: int | None = None,
        measure: str = "head",
        on_stale: str = "keep",
        versions_field: str = "versions",
        staleness: StalenessPolicy | None = None,
    ) -> BatchMeta:
        """Lease the ``batch_size`` oldest rows that have ``fields`` and ``task`` has not consumed.

        Waits (without polling) until enough rows are ready, or raises ``RequestTimeoutError``
        after ``timeout`` seconds (None: wait forever; 0: do not wait) saying what was missing.
        The lease lasts ``lease_timeout`` seconds (controller default when None): ``ack`` it to
        consume the rows, ``release`` it to give them back; an expired lease gives them back.

        Staleness window: with ``current_version=v, max_staleness=k`` only rows whose version
        (``measure``: "head" = version_start, "tail" = version_end, "dispatch") is at least
        ``v - k`` are selected (rows without a version always are); a group is stale if any
        member is. ``on_stale="drop"`` evicts the stale rows it meets (they can never be in a
        window again), counted in ``meta.stale_dropped`` and in stats; "keep" leaves them.
        ``measure="token"``: see :meth:`get` (the meta says so; ``get_data`` adds the mask).
        ``staleness``: the window as one :class:`~tqstream.StalenessPolicy` (what ``Experience``
        and the adapters hold), instead of ``max_staleness``, ``measure`` and ``on_stale``.
        """
        window = read_window(staleness, max_staleness, measure, on_stale)
        req = get_request(
            partition, fields, batch_size, task, whole_groups, lease_timeout, timeout,
            current_version, window, versions_field,
        )  # fmt: skip
        return self._sync(ClientCore.get_meta, req)

    async def async_get_meta(
        self,
        partition: str,
        fields: Sequence[str] | str,
        batch_size: int,
        task: str,
        *,
        whole_groups: bool = False,
        lease_timeout: float | None = None,
        timeout: float | None = None,
        current_version: int | None = None,
        max_staleness: int | None = None,
        measure: str = "head",
        on_stale: str = "keep",
        versions_field: str = "versions",
        staleness: StalenessPolicy | None = None,
    ) -> BatchMeta:
        window = read_window(staleness, max_staleness, measure, on_stale)
        req = get_request(
            partition, fields, batch_size, task, whole_groups, lease_timeout, timeout,
            current_version, window, versions_field,
        )  # fmt: skip
        return await self._async(ClientCore.get_meta, req)

    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        padded: bool = False,
        pad_values: PadValues = 0,
        copy: bool = False,
        versions_field: str = "versions",
    ) -> TensorDict:
        """The rows of ``meta`` as a TensorDict: dense fields dense, ragged fields as jagged
        nested tensors (or padded, with ``<field>_lengths``), object fields as NonTensorStack.

        The tensors are views of the received data — through shared memory, copy-on-write views of
        the storage unit's pages — unless ``copy=True`` asks for private copies (one memcpy).
        ``meta`` of a ``measure="token"`` read: ``fresh_mask`` comes along (see :meth:`get`)."""
        names = list(meta.fields if fields is None else fields)
        if meta.token_window is not None and versions_field not in names:
            names.append(versions_field)
        columns = self._sync(ClientCore.fetch, meta, names)
        _, columns = with_fresh_mask(meta, columns, versions_field)
        return _built(len(meta), *decode(len(meta), columns, padded, pad_values, copy))

    async def async_get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        padded: bool = False,
        pad_values: PadValues = 0,
        copy: bool = False,
        versions_field: str = "versions",
    ) -> TensorDict:
        names = list(meta.fields if fields is None else fields)
        if meta.token_window is not None and versions_field not in names:
            names.append(versions_field)
        columns = await self._async(ClientCore.fetch, meta, names)
        _, columns = with_fresh_mask(meta, columns, versions_field)
        return _built(len(meta), *decode(len(meta), columns, padded, pad_values, copy))

    def get(
        self,
        partition: str,
        fields: Sequence[str] | str,
        batch_size: int,
        task: str,
        *,
        whole_groups: bool = False,
        lease_timeout: float | None = None,
        timeout: float | None = None,
        padded: bool = False,
        pad_values: PadValues = 0,
        copy: bool = False,
        auto_ack: bool = False,
        current_version: int | None = None,
        max_staleness: int | None = None,
        measure: str = "head",
        on_stale: str = "keep",
        versions_field: str = "versions",
        staleness: StalenessPolicy | None = None,
    ) -> Batch:
        """``get_meta`` then ``get_data``; if fetching fails the lease is released.

        ``auto_ack=True`` acks the rows once their data is delivered (at-most-once for this
        task); by default the caller acks after using them (at-least-once).

        ``measure="token"``: a row is read while any of its generated tokens is inside the
        window (its newest token's version), and the batch gets a ``fresh_mask`` field, aligned
        with the per-token ``versions_field`` (read too): True on the generated tokens inside
        the window (prompt tokens, version -1, are False). ``meta.tokens_masked`` counts the
        generated tokens outside; acking the whole batch adds them to the task's
        ``tokens_masked`` in stats.
        """
        window = read_window(staleness, max_staleness, measure, on_stale)
        req = get_request(
            partition, fields, batch_size, task, whole_groups, lease_timeout, timeout,
            current_version, window, versions_field,
        )  # fmt: skip
        meta, columns = self._sync(ClientCore.get, req)  # one call: get_meta + fetch
        meta, columns = self._masked_or_release(meta, columns, versions_field)
        data, columns = self._decode_or_release(meta, columns, padded, pad_values, copy)
        if auto_ack:
            self.ack(meta)
        return Batch(meta, data, self, columns)

    async def async_get(
        self,
        partition: str,
        fields: Sequence[str] | str,
        batch_size: int,
        task: str,
        *,
        whole_groups: bool = False,
        lease_timeout: float | None = None,
        timeout: float | None = None,
        padded: bool = False,
        pad_values: PadValues = 0,
        copy: bool = False,
        auto_ack: bool = False,
        current_version: int | None = None,
        max_staleness: int | None = None,
        measure: str = "head",
        on_stale: str = "keep",
        versions_field: str = "versions",
        staleness: StalenessPolicy | None = None,
    ) -> Batch:
        window = read_window(staleness, max_staleness, measure, on_stale)
        req = get_request(
            partition, fields, batch_size, task, whole_groups, lease_timeout, timeout,
            current_version, window, versions_field,
        )  # fmt: skip
        meta, columns = await self._async(ClientCore.get, req)
        meta, columns = self._masked_or_release(meta, columns, versions_field)
        data, columns = self._decode_or_release(meta, columns, padded, pad_values, copy)
        if auto_ack:
            await self.async_ack(meta)
        return Batch(meta, data, self, columns)

    def _masked_or_release(
        self, meta: BatchMeta, columns: dict[str, Any], versions_field: str
    ) -> tuple[BatchMeta, dict[str, Any]]:
        """A token-measure read's mask (``requests.with_fresh_mask``); if it cannot be made
        (no per-token versions field), the lease is released."""
        try:
            return with_fresh_mask(meta, columns, versions_field)
        except BaseException:
            self._release_quietly(meta)
            raise

    def _decode_or_release(
        self,
        meta: BatchMeta,
        columns: dict[str, Any],
        padded: bool,
        pad_values: PadValues,
        copy: bool,
    ) -> tuple[TensorDict | None, dict[str, Column]]:
        """The batch's TensorDict (None: built on first use) and columns; if building it fails,
        the lease is released."""
        try:
            return decode(len(meta), columns, padded, pad_values, copy)
        except BaseException:
            self._release_quietly(meta)
            raise

    def _release_quietly(self, meta: BatchMeta) -> None:
        """Best effort: if it fails, the lease expires and the rows come back anyway."""
        if not self._closed:
            _release_on(self._io, self._core, meta)

    def get_by_keys(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        padded: bool = False,
        pad_values: PadValues = 0,
        copy: bool = False,
    ) -> Batch:
        """Read rows by key without leasing or consuming them (fields: all written when None)."""
        meta = self._sync(
            ClientCore.get_by_keys, partition, list(keys), None if fields is None else list(fields)
        )
        columns = self._sync(ClientCore.fetch, meta, list(meta.fields))
        data, columns = decode(len(meta), columns, padded, pad_values, copy)
        return Batch(meta, data, self, columns)

    async def async_get_by_keys(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        padded: bool = False,
        pad_values: PadValues = 0,
        copy: bool = False,
    ) -> Batch:
        meta = await self._async(
            ClientCore.get_by_keys, partition, list(keys), None if fields is None else list(fields)
        )
        columns = await self._async(ClientCore.fetch, meta, list(meta.fields))
        data, columns = decode(len(meta), columns, padded, pad_values, copy)
        return Batch(meta, data, self, columns)

    def set_tags(self, meta: BatchMeta, tags: Sequence[Mapping[str, Any] | None]) -> None:
        """Merge ``tags`` (one mapping or None per row of ``meta``, in its order) into the rows'
        tags, key by key."""
        self._sync(ClientCore.call, tags_message(meta, tags), MetaReply)

    async def async_set_tags(
        self, meta: BatchMeta, tags: Sequence[Mapping[str, Any] | None]
    ) -> None:
        await self._async(ClientCore.call, tags_message(meta, tags), MetaReply)

    def lookup(
        self,
        partition: str,
        keys: Sequence[str] = (),
        *,
        row_ids: Sequence[int] = (),
        fields: Sequence[str] | None = None,
        missing_ok: bool = False,
    ) -> BatchMeta:
        """The metadata of the rows of ``keys`` (or of ``row_ids``) in that order, without their
        data and without leasing them: keys, tags, where each row is stored, and ``fields`` (None:
        the fields all of them have; a field one of them lacks raises ``NotReadyError``). Rows that
        do not exist raise ``UnknownKeyError`` / ``UnknownRowError``; ``missing_ok=True`` leaves
        them out instead (and a partition that does not exist gives an empty batch)."""
        return self._sync(
            ClientCore.get_by_keys, partition, list(keys),
            None if fields is None else list(fields), list(row_ids), missing_ok,
        )  # fmt: skip

    async def async_lookup(
        self,
        partition: str,
        keys: Sequence[str] = (),
        *,
        row_ids: Sequence[int] = (),
        fields: Sequence[str] | None = None,
        missing_ok: bool = False,
    ) -> BatchMeta:
        return await self._async(
            ClientCore.get_by_keys, partition, list(keys),
            None if fields is None else list(fields), list(row_ids), missing_ok,
        )  # fmt: skip

    def list_keys(self, partition: str) -> list[str]:
        """Keys of the partition's visible rows, in put order."""
        return self._sync(ClientCore.list_keys, partition)

    async def async_list_keys(self, partition: str) -> list[str]:
        return await self._async(ClientCore.list_keys, partition)

    def list_rows(
        self, partition: str | None = None, *, fields: Sequence[str] = (), task: str | None = None
    ) -> dict[str, RowListing]:
        """Every visible row of ``partition`` (None: of every partition), in put order: keys,
        tags and where each is stored (``RowListing.meta``), whether ``fields`` are all written
        (``ready``) and whether ``task`` has it leased or acked (``consumed``). A scan of the
        partition at the controller, for bookkeeping and status checks, not for the data path."""
        msg = ListRows(rid=0, partition=partition, fields=list(fields), task=task)
        return self._sync(ClientCore.call, msg, RowsReply).rows

    async def async_list_rows(
        self, partition: str | None = None, *, fields: Sequence[str] = (), task: str | None = None
    ) -> dict[str, RowListing]:
        msg = ListRows(rid=0, partition=partition, fields=list(fields), task=task)
        return (await self._async(ClientCore.call, msg, RowsReply)).rows

    # --- admission ---
    def admission(self, style: str, *, name: str = "default", **config: int) -> AdmissionHandle:
        """Producer flow control kept at the controller (global across processes).

        ``style``: "capacity" (AReaL: max_concurrent, max_staleness, consumer_batch_size),
        "slots" (verl fully-async: max_pending_slots, max_version_slots, consumer_batch_size),
        or "per_version" (JAX-vLLM: max_per_version, update_interval). Creating the same
        admission again is harmless; a configuration that would deadlock raises AdmissionError.
        """
        msg = CreateAdmission(rid=0, name=name, style=check_style(style), config=dict(config))
        self._sync(ClientCore.call, msg)
        return AdmissionHandle(self, name, style)

    async def async_admission(
        self, style: str, *, name: str = "default", **config: int
    ) -> AdmissionHandle:
        msg = CreateAdmission(rid=0, name=name, style=check_style(style), config=dict(config))
        await self._async(ClientCore.call, msg)
        return AdmissionHandle(self, name, style)

    # --- consumption ---
    def ack(self, meta: BatchMeta, *, resumed: bool = False) -> int:
        """Consume the leased rows of ``meta`` for its task; returns how many were newly acked.

        ``resumed=True``: ``meta`` is a batch a checkpoint trained on, acked by the run resumed
        from it. Its lease may have ended since (the trainer died): its rows no other reader
        took meanwhile are consumed now; rows another reader took raise ``LeaseExpiredError``
        (they were trained on twice)."""
        return self._consume(meta, False, resumed)

    async def async_ack(self, meta: BatchMeta, *, resumed: bool = False) -> int:
        return await self._async(ClientCore.ack, meta, False, True, resumed)

    def reset_consumption(self, partition: str, task: str | None = None) -> int:
        """Make every row ``task`` (None: every task) has leased or acked available to it again,
        to read the data once more; its leases end (acking them later does nothing). Rows already
        freed (every registered task acked them) are gone. Returns the rows given back."""
        msg = ResetConsumption(rid=0, partition=partition, task=task)
        return self._sync(ClientCore.call, msg).count

    async def async_reset_consumption(self, partition: str, task: str | None = None) -> int:
        msg = ResetConsumption(rid=0, partition=partition, task=task)
        return (await self._async(ClientCore.call, msg)).count

    def release(self, meta: BatchMeta) -> int:
        """Give the leased rows back unconsumed; they keep their place in the order."""
        return self._consume(meta, True)

    def _consume(self, meta: BatchMeta, release: bool, resumed: bool = False) -> int:
        if self.config.coalesce_window:  # acks of several threads meet on the IO thread
            self._check()
            return self._io.run(ClientCore.ack(self._core, meta, release, True, resumed))  # type: ignore[no-any-return]
        return self._sync(ClientCore.ack, meta, release, False, resumed)  # type: ignore[no-any-return]

    async def async_release(self, meta: BatchMeta) -> int:
        return await self._async(ClientCore.ack, meta, True)

    def clear_samples(self, meta: BatchMeta) -> None:
        """Delete the rows of ``meta`` for every task and free their storage."""
        self._sync(ClientCore.clear_samples, meta)

    async def async_clear_samples(self, meta: BatchMeta) -> None:
        await self._async(ClientCore.clear_samples, meta)

    def clear_partition(self, partition: str) -> bool:
        """Delete the partition, its rows and bytes; waiting gets raise PartitionClearedError.

        Clearing makes sure the partition is gone: one that does not exist (never created, or
        cleared already) is left as it is. Returns whether the partition existed."""
        return self._sync(ClientCore.clear_partition, partition)

    async def async_clear_partition(self, partition: str) -> bool:
        return await self._async(ClientCore.clear_partition, partition)

    def stats(self, partition: str | None = None) -> Stats:
        """Rows, fields and per-task state per partition; bytes held per storage unit."""
        return self._sync(ClientCore.stats, partition)

    async def async_stats(self, partition: str | None = None) -> Stats:
        return await self._async(ClientCore.stats, partition)

    # --- checkpoints ---
    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> CheckpointSummary:
        """Write a consistent snapshot of the buffer to directory ``path``: every partition's
        committed rows (their data, keys, groups, versions, tags), each task's consumption
        (acked rows; leased rows are saved as available), the partitions' settings and the
        admissions. Puts and gets go on meanwhile; what they change after the snapshot is not in
        it. Returns once everything is on disk; a checkpoint already at ``path`` is replaced
        atomically. ``path`` is resolved here and must be on a filesystem the controller and
        every storage unit see (shared, with units on several hosts). ``metadata``: a JSON
        object kept with the checkpoint and returned by the load. ``timeout``: seconds for the
        storage units' writes (None: as long as they take). See docs/checkpoints.md."""
        msg = checkpoint_message(SaveCheckpoint, path, timeout, metadata)
        return self._sync(ClientCore.call, msg, CheckpointReply, reply_wait(timeout)).summary

    async def async_save_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> CheckpointSummary:
        msg = checkpoint_message(SaveCheckpoint, path, timeout, metadata)
        reply = await self._async(ClientCore.call, msg, CheckpointReply, reply_wait(timeout))
        return reply.summary

    def load_checkpoint(
        self, path: str | os.PathLike[str], *, timeout: float | None = None
    ) -> CheckpointSummary:
        """Restore the checkpoint at ``path`` into this cluster, which must hold no rows (empty
        partitions of the same names are replaced). The storage units may be as many as saved it
        or not (rows are then spread over them). Afterwards every task is served exactly the
        rows it had not acked; nothing of a load that fails is kept."""
        msg = checkpoint_message(LoadCheckpoint, path, timeout)
        return self._sync(ClientCore.call, msg, CheckpointReply, reply_wait(timeout)).summary

    async def async_load_checkpoint(
        self, path: str | os.PathLike[str], *, timeout: float | None = None
    ) -> CheckpointSummary:
        msg = checkpoint_message(LoadCheckpoint, path, timeout)
        reply = await self._async(ClientCore.call, msg, CheckpointReply, reply_wait(timeout))
        return reply.summary


def _built(n: int, data: TensorDict | None, columns: dict[str, Column]) -> TensorDict:
    return data if data is not None else to_tensordict(n, columns)


def _release_on(io: LoopThread, core: ClientCore, meta: BatchMeta) -> None:
    """Release ``meta``'s lease from the IO thread, in the background; best effort: if it
    fails, the lease expires and the rows come back anyway."""
    with contextlib.suppress(RuntimeError):  # the loop is closed
        io.loop.call_soon_threadsafe(core.release_soon, meta)


def _finalize(
    own: LoopThread | None,
    core: ClientCore,
    on_close: Callable[[], None] | None,
    borrowed: LoopThread | None = None,
    lanes: Lanes | None = None,
) -> None:
    """Close the lanes and the sockets on the loop; stop the loop if the client owns it; then
    ``on_close`` (an embedded cluster stops its servers, and the loop it lent the client)."""
    io = own or borrowed

    async def close() -> None:
        core.close()

    try:
        if lanes is not None:
            lanes.close()
        if io is not None and io.loop.is_running():
            io.submit(close()).result(timeout=10)
    finally:
        if own is not None:
            own.stop()
        if on_close is not None:
            on_close()


def connect(address: str, config: ClientConfig | None = None) -> Client:
    """Connect to a running controller (``tcp://HOST:PORT``, printed by ``tqstream-launch``)."""
    return Client(address, config)
