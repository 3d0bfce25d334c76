"""``ExperienceIterator``: batches of ``jax.Array`` read through a staleness window.

    it = ExperienceIterator(address, ["input_ids", "logprobs", "versions", "rewards"], 256,
                            staleness=StalenessPolicy(max_staleness=2), version_fn=lambda: v,
                            whole_groups=True, buckets=(64, 128, 256), pad_values={"versions": -1})
    for batch in it:                   # a JaxBatch: field -> jax.Array, plus its lease
        state = train_step(state, batch)   # jit compiles once per bucket
                                           # acked when the next batch is asked for

Rows are leased by the controller as for the torch ``ExperienceDataset``: several processes (or
hosts) reading one task never see a row twice, and a batch that is never acked (the trainer died)
comes back when its lease expires. ``state_dict()`` holds the batch yielded last and not acked
(the one the checkpointed step trained on), so a trainer restarted from its checkpoint acks it
and reads on: every row is trained on once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tqstream.adapters.common import Connection, Position, reader_window
from tqstream.adapters.jax.arrays import (
    bucket_for,
    check_buckets,
    dense,
    lengths_of,
    pack,
    pad_rows,
    to_jax,
    torch_view,
)
from tqstream.adapters.jax.batch import JaxBatch
from tqstream.adapters.jax.prefetch import Prefetcher
from tqstream.adapters.jax.sharding import Placement
from tqstream.client.batch import Batch
from tqstream.client.client import Client
from tqstream.client.versions import FRESH_MASK
from tqstream.convert.tensordict import decode_objects
from tqstream.errors import (
    BucketError,
    InvalidRequestError,
    PartitionDrainedError,
    RequestTimeoutError,
    SchemaError,
)
from tqstream.protocol.columns import Column
from tqstream.staleness import StalenessPolicy
from tqstream.types import BatchMeta

__all__ = ["ExperienceIterator"]

PadValues = float | Mapping[str, float]
_END = object()  # the prefetcher's mark for a finite stream that ended
_WAIT_SLICE = 0.5
"""How long a prefetcher's read waits for rows at a time when reads wait forever
(``timeout=None``): a read in flight cannot be called back, so close() waits up to that."""


class ExperienceIterator:
    """Batches of ``batch_size`` rows of ``fields`` read by ``task`` through ``staleness``.

    Arguments as :class:`tqstream.adapters.torch.ExperienceDataset`'s, plus what JAX needs:

    - ``buckets``: the lengths a ragged field is padded to, the smallest that fits its longest
      row (so a jitted step compiles once per bucket); one increasing sequence for every ragged
      field or a mapping of field to sequence (a field not named there is padded to its longest
      row). A row longer than the largest bucket: ``BucketError`` (the lease is given back).
      ``pad_values``: the pad, one for all or per field (default 0). ``<field>_lengths`` (int32)
      holds each row's length.
    - ``packed``: ragged fields returned packed instead, ``[bucket]`` tokens (the bucket of the
      batch's total) with ``<field>_segment_ids`` (row ``i`` -> ``i + 1``, padding 0).
    - ``sharding``: a ``NamedSharding`` whose first dimension splits the batch: this process
      leases its share and each field comes back as one global ``jax.Array``.
    - ``prefetch``: batches leased (and converted) ahead by a background thread, so reads go on
      while the trainer steps or pushes weights (their leases run meanwhile).
    - ``row_versions``: add each row's ``version_start`` / ``version_end`` (int32, -1: none).

    ``ack``: ``"next"`` acks a batch when the next one is asked for (after the step that used
    it); ``"manual"``: call :meth:`ack` after the step. A read that finds nothing within
    ``timeout`` raises ``RequestTimeoutError``; asking again goes on waiting.
    """

    def __init__(
        self, source: str | Client, fields: Sequence[str], batch_size: int, *,
        partition: str = "train", task: str = "actor", staleness: StalenessPolicy | None = None,
        version_fn: Callable[[], int] | None = None, whole_groups: bool = False,
        buckets: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
        pad_values: PadValues = 0, packed: Sequence[str] = (), ack: str = "next",
        finite: bool = False, timeout: float | None = None, lease_timeout: float | None = None,
        versions_field: str = "versions", sharding: Any = None, prefetch: int = 0,
        row_versions: bool = False,
    ) -> None:  # fmt: skip
        staleness = reader_window("ExperienceIterator", "ids", ack, fields, batch_size,
                                  staleness, version_fn)  # fmt: skip
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InvalidRequestError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.fields = list(fields)
        unknown = [f for f in packed if f not in self.fields]
        if unknown:
            raise InvalidRequestError(f"packed names fields not read: {unknown}")
        self.buckets = _buckets(buckets, self.fields)
        self.placement = Placement(sharding, batch_size)
        if packed and sharding is not None:
            raise InvalidRequestError(
                "packed fields have no batch axis to shard; with a sharding read them padded "
                "to buckets (or pack them per process, without a sharding)"
            )
        self._conn = Connection(source)
        self.batch_size, self.partition, self.task = batch_size, partition, task
        self.staleness, self.version_fn, self.whole_groups = staleness, version_fn, whole_groups
        self.pad_values, self.packed, self.ack_mode = pad_values, set(packed), ack
        self.finite, self.timeout, self.lease_timeout = finite, timeout, lease_timeout
        self.versions_field, self.prefetch, self.row_versions = (
            versions_field, prefetch, row_versions)  # fmt: skip
        self._position = Position()
        self._started = False
        self._ended = False
        self._ahead: Prefetcher | None = None

    # --- reading ---
    def __iter__(self) -> ExperienceIterator:
        return self

    def __next__(self) -> JaxBatch:
        client = self._start()
        self._position.ack_pending(client)
        if self._ended:
            raise StopIteration
        item = self._take() if self._ahead is not None else self._read(client, None, None)
        if item is _END:
            self._ended = True
            raise StopIteration
        batch = item if isinstance(item, JaxBatch) else self._convert(client, item)
        assert batch.meta is not None
        self._position.yielded_batch(batch.meta, self.ack_mode == "next")
        return batch

    def get_experience(
        self, count: int | None = None, current_version: int | None = None
    ) -> JaxBatch:
        """One batch (``count`` rows of this process, default its share of ``batch_size``;
        version from ``version_fn`` unless given), leased: ack it with :meth:`ack`."""
        client = self._start(prefetching=False)
        batch = self._read(client, count, current_version)
        if batch is _END:
            raise PartitionDrainedError(
                f"partition {self.partition!r} is closed and drained", partition=self.partition
            )
        return self._convert(client, batch)

    async def async_get_experience(
        self, count: int | None = None, current_version: int | None = None
    ) -> JaxBatch:
        client = self._start(prefetching=False)
        read = await client.async_get(**self._window(count, current_version))
        return self._convert(client, read)

    def _start(self, prefetching: bool = True) -> Client:
        client = self._conn.client()
        if not self._started:
            client.create_partition(self.partition, self.fields)  # wait for producers, not fail
            self._position.resume(client)  # raises: not started, nothing read
            self._started = True
        if prefetching and self.prefetch and self._ahead is None:
            read = functools.partial(self._read_ahead, client)
            self._ahead = Prefetcher(read, self.prefetch, _END, client)
        return client

    def _window(
        self, count: int | None, version: int | None, timeout: float | None = None
    ) -> dict[str, Any]:
        version = (None if self.version_fn is None else self.version_fn()) if version is None \
            else version  # fmt: skip
        return dict(
            partition=self.partition, fields=self.fields,
            batch_size=self.placement.local_rows if count is None else count, task=self.task,
            whole_groups=self.whole_groups, lease_timeout=self.lease_timeout,
            timeout=self.timeout if timeout is None else timeout, current_version=version,
            staleness=self.staleness, versions_field=self.versions_field,
        )  # fmt: skip

    def _read(
        self, client: Client, count: int | None, version: int | None,
        timeout: float | None = None,
    ) -> Any:  # fmt: skip
        """A leased batch (meta and columns), or ``_END`` once a finite stream is drained."""
        try:
            read = client.get(**self._window(count, version, timeout))
        except PartitionDrainedError:
            if not self.finite:
                raise
            return _END
        if (
            count is None
            and self.placement.sharding is not None
            and len(read) < self.placement.local_rows
        ):
            # a finite stream's last, short batch: no global shape fits it; it stays unread
            read.release()
            return _END
        return read

    def _read_ahead(self, client: Client, stop: threading.Event) -> Any:
        """The prefetcher's read: a batch (converted, where this process alone decides its
        shapes), ``_END``, or the error to hand over; None once ``stop`` is set. A read that
        would wait forever waits in slices of ``_WAIT_SLICE``, so close() stops it."""
        local = self.placement.processes == 1  # else conversion agrees on lengths: caller's thread
        wait = _WAIT_SLICE if self.timeout is None else self.timeout
        while not stop.is_set():
            try:
                item = self._read(client, None, None, wait)
                return self._convert(client, item) if local and item is not _END else item
            except RequestTimeoutError as exc:
                if self.timeout is not None:
                    return exc
            except BaseException as exc:
                return exc
        return None

    def _take(self) -> Any:
        assert self._ahead is not None
        item = self._ahead.take()
        if isinstance(item, BaseException):
            if not isinstance(item, RequestTimeoutError):
                self._ahead = None  # the prefetcher stopped; a later call starts another
            raise item
        return item

    # --- converting ---
    def _convert(self, client: Client, read: Batch) -> JaxBatch:
        """The leased batch as jax arrays; if that fails (a row longer than the buckets, a
        dtype JAX lacks) the lease goes back, so no other reader is kept from the rows."""
        try:
            return self._arrays(read.meta, read.columns or {})
        except BaseException:
            with contextlib.suppress(Exception):
                client.release(read.meta)
            raise

    def _arrays(self, meta: BatchMeta, columns: Mapping[str, Column]) -> JaxBatch:
        ragged = [n for n, c in columns.items() if c.schema.kind == "ragged" and n not in
                  self.packed]  # fmt: skip
        for name in ragged:
            if f"{name}_lengths" in columns:
                raise SchemaError(
                    f"cannot pad field {name!r}: its lengths go under {name}_lengths, which is "
                    f"also a field being read; rename it",
                    field=name,
                )
        longest = [int(lengths_of(columns[n]).max(initial=0)) for n in ragged]
        longest = self.placement.agree(longest)
        arrays: dict[str, jax.Array] = {}
        objects: dict[str, list[Any]] = {}
        for name, col in columns.items():
            kind = col.schema.kind
            if kind == "object":
                objects[name] = decode_objects(name, col)
            elif kind == "dense":
                arrays[name] = dense(name, col)
            elif name in self.packed:
                total = int(col.values.shape[0])
                length = bucket_for(name, total, self._bucket(name))
                arrays[name], arrays[f"{name}_segment_ids"] = pack(
                    name, col, length, self._pad(name)
                )
                arrays[f"{name}_lengths"] = to_jax(torch_view(lengths_of(col)))
            else:
                length = bucket_for(name, longest[ragged.index(name)], self._bucket(name))
                arrays[name] = pad_rows(name, col, length, self._pad(name))
                arrays[f"{name}_lengths"] = to_jax(torch_view(lengths_of(col)))
        if self.whole_groups:
            arrays["group_ids"] = to_jax(torch_view(self._group_ids(meta)))
        if self.row_versions:
            for key, values in (("version_start", meta.version_start),
                                ("version_end", meta.version_end)):  # fmt: skip
                row = np.asarray([-1 if v is None else v for v in values], dtype=np.int32)
                arrays[key] = to_jax(torch_view(row))
        batch_axis = {k for k in arrays if not k.endswith("_segment_ids")} - self.packed
        return JaxBatch(self.placement.globalize(arrays, batch_axis), meta, objects)

    def _bucket(self, name: str) -> tuple[int, ...] | None:
        if name == FRESH_MASK and name not in self.buckets:
            return self.buckets.get(self.versions_field)
        return self.buckets.get(name)

    def _pad(self, name: str) -> float:
        if isinstance(self.pad_values, Mapping):
            return self.pad_values.get(name, 0)
        return 0 if name == FRESH_MASK else self.pad_values

    def _group_ids(self, meta: BatchMeta) -> np.ndarray:
        """Each row's group numbered in the global batch (rows without a group: a number each);
        with several processes numbered after the rows of the processes before this one."""
        numbers: dict[Any, int] = {}
        base = self.placement.first_row
        out = np.empty(len(meta), dtype=np.int32)
        for i, g in enumerate(meta.groups):
            key = ("row", i) if g is None else g
            out[i] = base + numbers.setdefault(key, len(numbers))
        return out

    # --- acks ---
    def ack(self, batch: JaxBatch | BatchMeta) -> int:
        """Consume a batch after its step (``ack="manual"``); twice is harmless."""
        return self._conn.client().ack(_meta(batch))

    def release(self, batch: JaxBatch | BatchMeta) -> int:
        """Give a batch back unconsumed (another reader gets it now)."""
        return self._conn.client().release(_meta(batch))

    def close(self) -> None:
        """Stop prefetching and give back the batches leased ahead (not the one yielded last:
        with ``ack="next"`` ack it, or it returns to the task when its lease expires)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def __enter__(self) -> ExperienceIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- checkpoints ---
    def state_dict(self) -> dict[str, Any]:
        """The position: the controller holds what was consumed; this holds the batch yielded
        last and not yet acked (``ack="next"``), which the checkpointed step trained on."""
        return self._position.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the batch the checkpoint trained on is acked when reading starts."""
        self._position.load_state_dict(state)

    get_state = state_dict
    """grain's name for :meth:`state_dict`."""
    set_state = load_state_dict
    """grain's name for :meth:`load_state_dict`."""


def _meta(batch: JaxBatch | BatchMeta) -> BatchMeta:
    if isinstance(batch, BatchMeta):
        return batch
    if isinstance(batch, JaxBatch) and batch.meta is not None:
        return batch.meta
    raise InvalidRequestError(
        "this batch carries no tqstream lease: pass a batch exactly as ExperienceIterator "
        "yielded it (one rebuilt inside jax.jit has none), or its .meta"
    )


def _buckets(
    buckets: Sequence[int] | Mapping[str, Sequence[int]] | None, fields: list[str]
) -> dict[str, tuple[int, ...]]:
    if buckets is None:
        return {}
    if isinstance(buckets, Mapping):
        unknown = [k for k in buckets if k not in fields and k != FRESH_MASK]
        if unknown:
            raise BucketError(f"buckets name fields not read: {unknown} (fields: {fields})")
        return {k: check_buckets(k, v) for k, v in buckets.items()}
    every = check_buckets("*", buckets)
    return {**dict.fromkeys(fields, every), FRESH_MASK: every}
