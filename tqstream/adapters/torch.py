"""Plain PyTorch: an ``IterableDataset`` that reads fresh batches, and a writer for producers.

    writer = ExperienceWriter(address, partition="train")           # each rollout process
    writer.put_experience({"input_ids": [ids], "rewards": [r]}, current_version=v, group=uid)
    writer.close()                                                   # this producer is done

    ds = ExperienceDataset(address, ["input_ids", "rewards"], batch_size=64,
                           staleness=StalenessPolicy(max_staleness=2), version_fn=lambda: step)
    for batch in DataLoader(ds, batch_size=None, collate_fn=ExperienceDataset.collate):
        train(batch)            # acked when the next batch is asked for (ack="next")

Rows are handed out by the controller under leases, never by client-side sharding, so any number
of DataLoader workers, processes and data-parallel ranks reading one task never see a row twice
and never skip one: a batch that is not acked (the trainer crashed before its step ended) returns
to the others when its lease expires. Each process connects by itself (a ``Client`` cannot cross
a fork), so the dataset holds the cluster's address and pickles to workers as such.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch.utils.data import IterableDataset, get_worker_info

from tqstream.adapters.common import Connection as _Connection
from tqstream.adapters.common import ExperienceWriter, Position, reader_window
from tqstream.client.client import Client, PadValues
from tqstream.client.versions import tokens_outside
from tqstream.errors import InvalidRequestError, PartitionDrainedError
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta

__all__ = ["ExperienceDataset", "ExperienceWriter"]

META_KEY = "_tqstream_meta"  # the batch's lease, a non-tensor entry that crosses worker queues
_NEXT_IN_WORKER = (
    "ack='next' acks a batch when the next one is asked for, but a DataLoader worker is asked "
    "ahead of the training step; with num_workers > 0 build the dataset with ack='manual' and "
    "call dataset.ack(batch) after each step"
)


def meta_of(batch: TensorDictBase) -> BatchMeta:
    """The lease of a batch yielded by :class:`ExperienceDataset` (to ack it elsewhere)."""
    raw = batch.get_non_tensor(META_KEY, default=None)
    if raw is None:
        raise InvalidRequestError(
            f"this TensorDict carries no tqstream lease ({META_KEY!r}): pass a batch exactly as "
            f"ExperienceDataset yielded it"
        )
    return msgspec.convert(raw, BatchMeta)


class ExperienceDataset(IterableDataset[TensorDictBase]):
    """Batches of ``batch_size`` rows of ``fields`` read by ``task`` through a staleness window.

    Each yielded ``TensorDict`` holds the fields (ragged ones as jagged nested tensors, or with
    ``padded=True`` padded plus ``<field>_lengths``) and its lease under ``"_tqstream_meta"``.
    ``version_fn() -> int`` gives the trainer's current policy version for each read (needed by a
    staleness window; it also feeds the per-task lag histogram).

    ``ack``: ``"next"`` acks a batch when the next one is asked for, i.e. after the training
    step that used it (``num_workers=0``: a worker is asked ahead of the trainer, so it cannot
    know); ``"manual"``: call :meth:`ack` with the batch after the step (any ``num_workers``).
    Unacked rows go back to the task when their lease expires, so a crash loses nothing.

    ``finite``: end the iteration once the producers closed the partition
    (``ExperienceWriter.close``) and it is drained; otherwise iterate forever, waiting for rows.

    ``staleness.measure == "token"``: each batch also holds ``fresh_mask`` (per generated token of
    ``versions_field``, inside the window; see ``Client.get``).

    ``share_group``: the ``torch.distributed`` group of ranks that share a data-parallel rank
    (tensor/pipeline/sequence-parallel peers): its first rank leases each batch and sends the
    lease to the others, so they all train on identical rows; different data-parallel ranks
    lease disjoint rows. Needs ``num_workers=0``.
    """

    def __init__(
        self, source: str | Client, fields: Sequence[str], batch_size: int, *,
        partition: str = "train", task: str = "actor",
        staleness: StalenessPolicy | None = None,
        version_fn: Callable[[], int] | None = None, whole_groups: bool = False,
        padded: bool = False, pad_values: PadValues = 0, ack: str = "next", finite: bool = False,
        timeout: float | None = None, lease_timeout: float | None = None,
        share_group: Any = None, versions_field: str = "versions",
    ) -> None:  # fmt: skip
        staleness = reader_window("ExperienceDataset", "input_ids", ack, fields, batch_size,
                                  staleness, version_fn)  # fmt: skip
        self._conn = _Connection(source)
        self.fields, self.batch_size, self.partition, self.task = (
            list(fields), batch_size, partition, task)  # fmt: skip
        self.staleness, self.version_fn, self.whole_groups = staleness, version_fn, whole_groups
        self.padded, self.pad_values, self.ack_mode, self.finite = padded, pad_values, ack, finite
        self.timeout, self.lease_timeout, self.share_group = timeout, lease_timeout, share_group
        self.versions_field = versions_field
        self._position = Position()

    @staticmethod
    def collate(batch: TensorDictBase) -> TensorDictBase:
        """``DataLoader(..., batch_size=None, collate_fn=ExperienceDataset.collate)``: batches
        are already whole (the default would try to convert a TensorDict row by row)."""
        return batch

    def loader(self, num_workers: int = 0, **kwargs: Any) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` over this dataset with the settings it needs. With workers, batches
        are delivered as they come (``in_order=False``): in order, a worker's batch would wait
        for a slower worker's turn while its lease runs."""
        if num_workers > 0:
            if self.ack_mode == "next":
                raise InvalidRequestError(_NEXT_IN_WORKER)
            kwargs.setdefault("in_order", False)
        return torch.utils.data.DataLoader(
            self, batch_size=None, collate_fn=ExperienceDataset.collate,
            num_workers=num_workers, **kwargs,
        )  # fmt: skip

    # --- reading ---
    def _version(self) -> int | None:
        return None if self.version_fn is None else self.version_fn()

    def _batch(self, client: Client, meta: BatchMeta) -> TensorDictBase:
        data = client.get_data(meta, padded=self.padded, pad_values=self.pad_values,
                               versions_field=self.versions_field)  # fmt: skip
        return self._with_meta(data, meta)

    def _with_meta(self, data: TensorDictBase, meta: BatchMeta) -> TensorDictBase:
        if meta.token_window is not None:  # counted in the task's stats when the batch is acked
            masked = tokens_outside(data, self.versions_field)
            meta = msgspec.structs.replace(meta, tokens_masked=masked)
        data.set_non_tensor(META_KEY, msgspec.to_builtins(meta))
        return data

    def __iter__(self) -> Iterator[TensorDictBase]:
        in_worker = get_worker_info() is not None
        if in_worker and self.ack_mode == "next":
            raise InvalidRequestError(_NEXT_IN_WORKER)
        if in_worker and self.share_group is not None:
            raise InvalidRequestError(
                "share_group sends each lease over torch.distributed, which DataLoader workers "
                "cannot use: read with num_workers=0"
            )
        client = self._conn.client()
        client.create_partition(self.partition, self.fields)  # wait for producers, not fail
        self._position.resume(client)  # the batch the checkpoint this run resumes from trained on
        while True:
            self._position.ack_pending(client)
            meta = self._next_meta(client)
            if meta is None:
                return
            self._position.yielded_batch(meta, self.ack_mode == "next" and self._leader)
            yield self._batch(client, meta)

    @property
    def _leader(self) -> bool:
        return self.share_group is None or dist.get_rank(self.share_group) == 0

    def _next_meta(self, client: Client) -> BatchMeta | None:
        """The next lease (None: the finite stream ended), shared across ``share_group``."""
        meta: BatchMeta | None = None
        if self._leader:
            try:
                meta = client.get_meta(**self._window(None, None))
            except PartitionDrainedError:
                if not self.finite:
                    raise
        if self.share_group is not None:
            meta = _broadcast_meta(meta, self.share_group)
        return meta

    def _window(self, count: int | None, version: int | None) -> dict[str, Any]:
        version = self._version() if version is None else version
        return dict(
            partition=self.partition, fields=self.fields,
            batch_size=self.batch_size if count is None else count, task=self.task,
            whole_groups=self.whole_groups, lease_timeout=self.lease_timeout,
            timeout=self.timeout, current_version=version, staleness=self.staleness,
            versions_field=self.versions_field,
        )  # fmt: skip

    def get_experience(self, count: int | None = None, current_version: int | None = None
                       ) -> TensorDictBase:  # fmt: skip
        """One batch outside a DataLoader (``count`` rows, default ``batch_size``; version from
        ``version_fn`` unless given), with its lease: ack it with :meth:`ack`."""
        client = self._conn.client()
        return self._batch(client, client.get_meta(**self._window(count, current_version)))

    async def async_get_experience(
        self, count: int | None = None, current_version: int | None = None
    ) -> TensorDictBase:
        client = self._conn.client()
        meta = await client.async_get_meta(**self._window(count, current_version))
        data = await client.async_get_data(meta, padded=self.padded, pad_values=self.pad_values,
                                           versions_field=self.versions_field)  # fmt: skip
        data = self._with_meta(data, meta)
        return data

    # --- acks ---
    def ack(self, batch: TensorDictBase | BatchMeta) -> int:
        """Consume a yielded batch (``ack="manual"``), from any process; twice is harmless."""
        meta = batch if isinstance(batch, BatchMeta) else meta_of(batch)
        return self._conn.client().ack(meta)

    def release(self, batch: TensorDictBase | BatchMeta) -> int:
        """Give a yielded batch back unconsumed (another reader gets it now)."""
        meta = batch if isinstance(batch, BatchMeta) else meta_of(batch)
        return self._conn.client().release(meta)

    # --- StatefulDataLoader ---
    def state_dict(self) -> dict[str, Any]:
        """The position: the controller holds what was consumed; this holds the batch yielded
        last and not yet acked (``ack="next"``), which the checkpointed step trained on."""
        return self._position.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the batch the checkpoint trained on is acked when iteration starts."""
        self._position.load_state_dict(state)


def _broadcast_meta(meta: BatchMeta | None, group: Any) -> BatchMeta | None:
    """The group's first rank's lease to every rank of ``group`` (None: end of stream), as
    msgpack bytes in a uint8 tensor over the group's own backend."""
    src = dist.get_global_rank(group, 0)
    payload = b"" if meta is None else msgspec.msgpack.encode(meta)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if n == 0:
        return None
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(n, dtype=torch.uint8)
    )
    dist.broadcast(buf, src=src, group=group)
    return msgspec.msgpack.decode(buf.numpy().tobytes(), type=BatchMeta)
