"""A drop-in for the fully-async recipe's ``MessageQueueClient`` that never drops a sample.

verl's ``MessageQueue`` (``verl.experimental.fully_async_policy.message_queue``) is one Ray actor
holding cloudpickled ``RolloutSample`` s in a ``deque(maxlen=max_queue_size)``: when it is full,
``put_sample`` silently evicts the *oldest* sample and returns False. This client keeps the same
methods, async and ``*_sync``, with the same parameters and return shapes, and stores each
``RolloutSample`` in tqstream instead: its ``full_batch`` as unpadded rows (``dataproto_to_rows``)
and ``sample_id`` / ``epoch`` / ``rollout_status`` in one small header row, so nothing is pickled
and any process can read it. A full queue applies back-pressure: ``put_sample`` waits at the
controller (a slot of a ``slots`` admission bounds the samples queued, globally) until the trainer
takes one, and counts the wait; with ``put_timeout`` it gives up after that long, stores nothing and
returns False (verl's "not put"), counted too. Nothing is ever evicted to make room.

Storage: partition ``name`` holds the headers (one row per queued sample, consumed by ``task``),
``name + ".rows"`` the samples' rows (cleared once the sample is taken), ``name + ".validate"``
``put_validate`` values; admission ``name + ".queue"`` the queue's capacity.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Sequence
from typing import Any

from tqstream.adapters import require
from tqstream.adapters.verl.dataproto import RowBatch, dataproto_to_rows
from tqstream.adapters.verl.layout import json_problem
from tqstream.adapters.verl.rebuild import rows_to_dataproto
from tqstream.client.client import Batch, Client, connect
from tqstream.errors import (
    InvalidRequestError,
    PartitionDrainedError,
    RequestTimeoutError,
    SchemaError,
    TQStreamError,
)
from tqstream.types import CheckpointSummary, PartitionStats

__all__ = ["MessageQueueClient"]

SAMPLE_FIELD = "rollout_sample"
VALUE_FIELD = "value"
_NO_WINDOW = 2**62  # the queue bounds samples queued (pending slots), not per weight version
_INSTALL = "pip install verl==0.9.1 cachetools fastapi uvicorn"


def _rollout_sample_class() -> Any:
    """verl's ``RolloutSample`` (its module imports verl's trainer, so only when a get needs it)."""
    mod = require("verl.experimental.fully_async_policy.detach_utils", "verl", _INSTALL)
    return mod.RolloutSample


class MessageQueueClient:
    """verl's ``MessageQueueClient`` on tqstream (see the module docstring).

    ``client``: a tqstream client, or its address (then this object connects and owns the
    connection). ``max_queue_size``: samples queued at most (verl's ``max_queue_size``).
    ``task``: the consumer task name. ``put_timeout``: seconds a ``put_sample`` waits for room
    (None: as long as it takes). ``response_fields`` / ``pad_token_id``: see
    ``dataproto_to_rows``. Every process builds its own from the same ``name`` (pickling one
    carries the address and settings, so Ray can hand it to actors as verl does).
    """

    def __init__(
        self, client: Client | str, *, name: str = "fully_async", max_queue_size: int = 1000,
        task: str = "trainer", put_timeout: float | None = None,
        response_fields: Sequence[str] = (), pad_token_id: int | None = None,
    ) -> None:  # fmt: skip
        if type(max_queue_size) is not int or max_queue_size < 1:
            raise InvalidRequestError(
                f"max_queue_size must be an int >= 1 (the samples the queue may hold), got "
                f"{max_queue_size!r}"
            )
        self._owns = isinstance(client, str)
        self.client = connect(client) if isinstance(client, str) else client
        self.name, self.task, self.max_queue_size = name, task, max_queue_size
        self.put_timeout, self.pad_token_id = put_timeout, pad_token_id
        self.response_fields = tuple(response_fields)
        self.samples, self.rows, self.validate = name, f"{name}.rows", f"{name}.validate"
        self.blocked_puts = 0  # put_sample calls that had to wait for room (this object)
        self.put_timeouts = 0  # ... that gave up after put_timeout, storing nothing
        self.cleared_samples = 0  # samples removed by clear_queue (this object)
        try:
            self.admission = self.client.admission(
                "slots", name=f"{name}.queue", max_pending_slots=max_queue_size,
                max_version_slots=_NO_WINDOW,
            )  # fmt: skip
            self._create_partitions()
        except BaseException:
            self.close()
            raise

    def _create_partitions(self) -> None:
        self.client.create_partition(self.samples, [SAMPLE_FIELD], tasks=[self.task])
        self.client.create_partition(self.rows)
        self.client.create_partition(self.validate, [VALUE_FIELD], tasks=[self.task])

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickled (e.g. by Ray, handing it to an actor) as its address and settings: the
        unpickled copy connects anew in its process."""
        build = functools.partial(
            MessageQueueClient, name=self.name, max_queue_size=self.max_queue_size,
            task=self.task, put_timeout=self.put_timeout, response_fields=self.response_fields,
            pad_token_id=self.pad_token_id,
        )  # fmt: skip
        return build, (self.client.address,)

    def close(self) -> None:
        """Close the connection if this object opened it (built from an address)."""
        if self._owns and hasattr(self, "client"):
            self.client.close()

    # --- producer ---
    def _encode(self, sample: Any) -> tuple[dict[str, Any], RowBatch]:
        """The header and rows of a ``RolloutSample``; raises (nothing stored) on bad input."""
        if isinstance(sample, (bytes, bytearray, memoryview)):
            raise InvalidRequestError(
                f"put_sample got {len(sample)} bytes, a pickled sample (verl 0.9.1's rollouter "
                f"passes ray.cloudpickle.dumps(rollout_sample)); tqstream never unpickles what it "
                f"stores, since a peer that can reach it could then run code: pass the "
                f"RolloutSample itself (and drop the trainer's ray.cloudpickle.loads)"
            )
        missing = [a for a in ("full_batch", "sample_id", "epoch", "rollout_status")
                   if not hasattr(sample, a)]  # fmt: skip
        if missing:
            raise InvalidRequestError(
                f"put_sample needs a verl RolloutSample (or None, the end of the stream), got "
                f"{type(sample).__name__} without {missing}"
            )
        header = {
            "sample_id": sample.sample_id,
            "epoch": sample.epoch,
            "rollout_status": sample.rollout_status,
        }
        for key, value in header.items():
            problem = json_problem(value)
            if problem is not None:
                raise SchemaError(
                    f"RolloutSample.{key} holds {problem}, which would not come back as it was "
                    f"put; keep it to JSON values"
                )
        rows = dataproto_to_rows(
            sample.full_batch, response_fields=self.response_fields, pad_token_id=self.pad_token_id
        )
        return header, rows

    def _keys(self, header: dict[str, Any], rows: RowBatch, slot: int) -> list[str]:
        header["key"], header["rows"], header["slot"] = uuid.uuid4().hex, len(rows), slot
        return [f"{header['key']}/{i}" for i in range(len(rows))]

    async def put_sample(self, sample: Any) -> bool:
        """Queue a ``RolloutSample`` (None: the end of the stream, after which getters drain the
        queue and then get ``(None, 0)``). Waits while the queue is full; True once stored, False
        if ``put_timeout`` passed first (nothing stored)."""
        if sample is None:
            await self.shutdown()
            return True
        header, rows = self._encode(sample)
        ids = await self.admission.async_try_acquire(1)
        if not ids:
            self.blocked_puts += 1
            try:
                ids = await self.admission.async_acquire(1, timeout=self.put_timeout)
            except RequestTimeoutError:
                self.put_timeouts += 1
                return False
        keys = self._keys(header, rows, ids[0])
        meta = None
        try:
            meta = await self.client.async_put(rows.data, self.rows, keys=keys)
            await self.client.async_put(
                {SAMPLE_FIELD: [header]}, self.samples, keys=[header["key"]]
            )
        except BaseException:  # undo what was done; the put's error is the one to report
            with contextlib.suppress(TQStreamError):
                await self.admission.async_release(ids, "rejected")
            if meta is not None:
                with contextlib.suppress(TQStreamError):
                    await self.client.async_clear_samples(meta)
            raise
        return True

    # --- consumer ---
    def _sample(self, header: dict[str, Any], rows: Batch) -> Any:
        full_batch = rows_to_dataproto(rows, pad_token_id=self.pad_token_id)
        return _rollout_sample_class()(
            full_batch=full_batch,
            sample_id=header["sample_id"],
            epoch=header["epoch"],
            rollout_status=header["rollout_status"],
        )

    @staticmethod
    def _header(batch: Batch) -> tuple[dict[str, Any], list[str]]:
        header = batch.data.get(SAMPLE_FIELD).tolist()[0]
        return header, [f"{header['key']}/{i}" for i in range(header["rows"])]

    async def get_sample(self) -> Any | None:
        """The oldest queued sample as ``(RolloutSample, samples left)``, waiting for one; after
        the end of the stream, once drained, ``(None, 0)``."""
        try:
            batch = await self.client.async_get(self.samples, [SAMPLE_FIELD], 1, self.task)
        except PartitionDrainedError:
            return None, 0
        try:
            header, keys = self._header(batch)
            rows = await self.client.async_get_by_keys(self.rows, keys)
            sample = self._sample(header, rows)
        except BaseException:
            with contextlib.suppress(TQStreamError):
                await batch.async_release()
            raise
        await batch.async_ack()
        await self.admission.async_release([header["slot"]], "accepted")
        await self.client.async_clear_samples(rows.meta)
        return sample, await self.get_queue_size()

    def get_sample_sync(self) -> Any | None:
        try:
            batch = self.client.get(self.samples, [SAMPLE_FIELD], 1, self.task)
        except PartitionDrainedError:
            return None, 0
        try:
            header, keys = self._header(batch)
            rows = self.client.get_by_keys(self.rows, keys)
            sample = self._sample(header, rows)
        except BaseException:
            with contextlib.suppress(TQStreamError):
                batch.release()
            raise
        batch.ack()
        self.admission.release([header["slot"]], "accepted")
        self.client.clear_samples(rows.meta)
        return sample, self.get_queue_size_sync()

    # --- validation values ---
    async def put_validate(self, data: Any) -> bool:
        """Queue a validation result (a JSON value, e.g. metrics) for ``get_validate_sync``."""
        await self.client.async_put({VALUE_FIELD: [_json_value(data)]}, self.validate)
        return True

    def get_validate_sync(self) -> Any | None:
        """The oldest validation result, or None when there is none (never waits)."""
        try:
            batch = self.client.get(self.validate, [VALUE_FIELD], 1, self.task, timeout=0)
        except (RequestTimeoutError, PartitionDrainedError):
            return None
        batch.ack()
        return batch.data.get(VALUE_FIELD).tolist()[0]

    # --- state ---
    def _size(self, part: PartitionStats | None) -> int:
        if part is None:
            return 0
        t = part.tasks.get(self.task)
        return part.rows if t is None else t.available

    def _statistics(self, part: PartitionStats | None) -> dict[str, Any]:
        return {
            "queue_size": self._size(part),
            "total_produced": 0 if part is None else part.produced,
            "total_consumed": 0 if part is None else part.freed,
            "dropped_samples": 0 if part is None else part.stale_dropped + part.expired,
            "max_queue_size": self.max_queue_size,
            "blocked_puts": self.blocked_puts,
            "put_timeouts": self.put_timeouts,
            "cleared_samples": self.cleared_samples,
        }

    async def get_queue_size(self) -> int:
        """Samples queued and not yet taken by a get."""
        return self._size(
            (await self.client.async_stats(self.samples)).partitions.get(self.samples)
        )

    def get_queue_size_sync(self) -> int:
        return self._size(self.client.stats(self.samples).partitions.get(self.samples))

    async def get_statistics(self) -> dict[str, Any]:
        """verl's counters (``queue_size``, ``total_produced``, ``total_consumed``,
        ``dropped_samples``: always 0 here, ``max_queue_size``) plus this object's back-pressure
        counters (``blocked_puts``, ``put_timeouts``) and ``cleared_samples``."""
        stats = await self.client.async_stats(self.samples)
        return self._statistics(stats.partitions.get(self.samples))

    def get_statistics_sync(self) -> dict[str, Any]:
        return self._statistics(self.client.stats(self.samples).partitions.get(self.samples))

    async def get_memory_usage(self) -> dict:
        """``queue_samples`` and the bytes the storage units hold (every partition's)."""
        stats = await self.client.async_stats(self.samples)
        nbytes = stats.storage_bytes
        return {
            "queue_samples": self._size(stats.partitions.get(self.samples)),
            "estimated_memory_bytes": nbytes,
            "estimated_memory_mb": nbytes / (1024 * 1024),
        }

    async def clear_queue(self) -> None:
        """Remove every queued sample (counted in ``cleared_samples``) and give their room back."""
        keys = await self.client.async_list_keys(self.samples)
        if keys:
            batch = await self.client.async_get_by_keys(self.samples, keys, [SAMPLE_FIELD])
            slots = [h["slot"] for h in batch.data.get(SAMPLE_FIELD).tolist()]
            await self.admission.async_release(slots, "rejected")
        for partition in (self.samples, self.rows):
            await self.client.async_clear_partition(partition)
        await self.client.async_create_partition(self.samples, [SAMPLE_FIELD], tasks=[self.task])
        await self.client.async_create_partition(self.rows)
        self.cleared_samples += len(keys)

    async def shutdown(self) -> None:
        """The end of the stream: no more samples; getters drain the queue, then get
        ``(None, 0)``."""
        await self.client.async_close_partition(self.samples)

    # --- checkpoints: transfer_queue's save_checkpoint / load_checkpoint, as verl calls them ---
    def save_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        include_storage: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> CheckpointSummary:
        """verl's ``tq.save_checkpoint(path, metadata={"global_steps": step})``: a consistent
        checkpoint of the whole buffer (this queue's samples, their admission slots, and every
        other partition of the cluster) in directory ``checkpoint_dir``, replaced atomically if
        it exists. Blocking, as verl's trainer calls it (``async_save_checkpoint``: the
        coroutine). ``include_storage`` is accepted for its signature and ignored: the samples
        are in memory, so they are always saved (TransferQueue's in-memory storage ignores it
        too). See docs/checkpoints.md."""
        return self.client.save_checkpoint(checkpoint_dir, metadata=metadata)

    async def async_save_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        include_storage: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> CheckpointSummary:
        return await self.client.async_save_checkpoint(checkpoint_dir, metadata=metadata)

    def load_checkpoint(self, checkpoint_dir: str | os.PathLike[str]) -> CheckpointSummary:
        """verl's ``tq.load_checkpoint(path)``, into a cluster that holds no samples yet (this
        queue's own partitions, empty since it was built, are replaced): then ``get_sample``
        returns the samples that were queued at the save, oldest first, and the queue's slots
        count them as before."""
        return self.client.load_checkpoint(checkpoint_dir)

    async def async_load_checkpoint(
        self, checkpoint_dir: str | os.PathLike[str]
    ) -> CheckpointSummary:
        return await self.client.async_load_checkpoint(checkpoint_dir)


def _json_value(data: Any) -> Any:
    problem = json_problem(data)
    if problem is not None:
        raise SchemaError(
            f"put_validate data holds {problem}; tqstream stores validation results as JSON "
            f"values (e.g. a dict of metrics), never pickled"
        )
    return data
