"""NeMo-RL's ``DataPlaneClient`` on tqstream.

How NeMo-RL's calls land on tqstream (docs/adapters/nemo_rl.md has the full table):

- ``register_partition`` declares the fields (claims wait for them) and registers the consumer
  tasks (claims for other tasks raise). A partition that holds no rows is first dropped, so
  re-registering starts from a clean record and new schemas, as NeMo-RL's reference client does.
  Rows of a registered partition stay until ``clear_samples``: besides NeMo-RL's tasks the
  partition registers :data:`HOLD_TASK`, which never reads, so no ack ever frees a row.
- ``claim_meta`` leases the ``batch_size`` oldest rows with every required field to the task,
  waiting at the controller (no polling); all or nothing, as with TransferQueue. The lease is what
  keeps a claimed row from being claimed again. When this client closes, its claims are acked
  (consumed for good); if the process dies first, the controller gives them back to the task at
  once, so a crashed consumer loses nothing.
- ``put_samples`` is a key-value write (``put_by_keys``): new keys become rows, fields are
  replaced, tags are merged key by key at the controller. New rows tagged with an int
  ``weight_version`` are put with that policy version, and keys ``{uid}_g{i}`` give them the
  group ``uid``, so staleness windows and whole-group samplers apply to them.
- ``get_samples`` / ``get_data`` read by key in request order without touching any claim; a
  missing key, partition or field raises a ``KeyError`` (TransferQueue returned fewer rows).
- ``clear_samples`` deletes rows (``None``: the whole partition, its registration included).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from tensordict import TensorDict

from tqstream.adapters.nemo_rl.compat import DataPlaneClient, KVBatchMeta
from tqstream.adapters.nemo_rl.config import TQStreamDataPlaneConfig
from tqstream.adapters.nemo_rl.convert import (
    check_names,
    densify,
    put_fields,
    put_tags,
    row_metadata,
)
from tqstream.adapters.nemo_rl.deploy import open_cluster
from tqstream.adapters.nemo_rl.errors import NotProducedError, UnknownTaskError
from tqstream.client.client import Client
from tqstream.errors import (
    DuplicateKeyError,
    GroupError,
    InvalidRequestError,
    NotReadyError,
    RequestTimeoutError,
    TQStreamError,
    UnknownPartitionError,
)
from tqstream.types import BatchMeta

__all__ = ["HOLD_TASK", "TQStreamDataPlaneClient"]

HOLD_TASK = "nemo_rl:until_clear"
"""A task registered on every registered partition that never reads: rows are freed by
``clear_samples`` only, never by acks (NeMo-RL reads claimed rows by key until it clears them)."""

LENGTHS_TAG = "input_lengths"
"""The tag a claim's ``sequence_lengths`` come from, as with NeMo-RL's TransferQueue client."""


class TQStreamDataPlaneClient(DataPlaneClient):
    """NeMo-RL's ``DataPlaneClient`` backed by a tqstream cluster.

    Built as NeMo-RL builds its clients, from the ``data_plane`` configuration dict and
    ``bootstrap`` (True in the driver, which may start the cluster; False in workers, which attach;
    see ``config.py`` and ``deploy.py``), or around an existing ``client`` (not closed by
    :meth:`close`). ``config`` overrides the settings read from ``cfg``. Thread-safe.
    """

    def __init__(
        self,
        cfg: Mapping[str, Any] | None = None,
        *,
        bootstrap: bool = True,
        client: Client | None = None,
        config: TQStreamDataPlaneConfig | None = None,
    ) -> None:
        if config is None:
            config = (
                TQStreamDataPlaneConfig.from_dataplane_config(cfg)
                if cfg is not None
                else TQStreamDataPlaneConfig()
            )
        self.config = config
        stop: Callable[[], None] | None = None
        if client is None:
            client, stop = open_cluster(config, bootstrap, cfg)
            owned: Client | None = client
        else:
            owned = None
        self.client = client
        self._lock = threading.Lock()
        self._claims: dict[str, list[BatchMeta]] = {}  # per partition, leases acked at close
        self._tasks: dict[str, frozenset[str]] = {}  # registered tasks seen, per partition
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, owned, stop)

    def __enter__(self) -> TQStreamDataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- (A) task-mediated ---
    def register_partition(
        self,
        partition_id: str,
        fields: list[str],
        num_samples: int,
        consumer_tasks: list[str],
        grpo_group_size: int | None = None,
        enums: dict[str, list[str]] | None = None,
    ) -> None:
        """Declare ``fields`` and register ``consumer_tasks``. ``num_samples``,
        ``grpo_group_size`` and ``enums`` are accepted and not needed: tqstream sizes itself per
        put, groups come with the rows, and strings are stored as they are."""
        names = check_names(fields, "fields")
        tasks = check_names(consumer_tasks, "consumer_tasks")
        if not isinstance(num_samples, int) or num_samples < 0:
            raise InvalidRequestError(f"num_samples must be an int >= 0, got {num_samples!r}")
        try:
            held = self.client.stats(partition_id).partitions[partition_id]
        except UnknownPartitionError:
            held = None
        if held is not None and held.rows == 0 and held.pending_puts == 0:
            self.client.clear_partition(partition_id)  # a fresh record, as a new registration
        self.client.create_partition(partition_id, names, tasks=[*tasks, HOLD_TASK])
        with self._lock:
            self._tasks[partition_id] = frozenset(tasks)

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: list[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta:
        """Claim exactly ``batch_size`` rows that have every ``required_fields`` and that
        ``task_name`` has not claimed: the oldest first. Blocking: wait up to ``timeout_s``, then
        ``RequestTimeoutError`` (a ``TimeoutError``) saying what was missing; non-blocking: an
        empty meta when not enough rows are ready. ``dp_rank`` is accepted and unused (NeMo-RL
        shards on the driver)."""
        fields = check_names(required_fields, "required_fields", empty_ok=False)
        self._check_task(partition_id, task_name)
        timeout = max(0.0, float(timeout_s)) if blocking else 0.0
        try:
            meta = self._claim(partition_id, fields, batch_size, task_name, timeout=timeout)
        except RequestTimeoutError:
            if blocking:
                raise
            return KVBatchMeta(partition_id, task_name, [], fields=fields)
        return self._claimed(meta, fields)

    def _claim(
        self, partition_id: str, fields: list[str], rows: int, task: str, **request: Any
    ) -> BatchMeta:
        """Lease ``rows`` rows to ``task`` as a claim of this client (acked at close)."""
        meta = self.client.get_meta(
            partition_id,
            fields,
            rows,
            task,
            lease_timeout=self.config.claim_lease_timeout_s,
            **request,
        )
        with self._lock:
            self._claims.setdefault(partition_id, []).append(meta)
        return meta

    @staticmethod
    def _claimed(meta: BatchMeta, fields: list[str]) -> KVBatchMeta:
        """NeMo-RL's view of a claim: keys, the fields asked for, tags, lengths from tags."""
        tags: list[dict[str, Any]] = (
            [dict(t) for t in meta.tags] if meta.tags else [{} for _ in meta.keys]
        )
        lengths = None
        if any(LENGTHS_TAG in t for t in tags):
            lengths = [int(t.get(LENGTHS_TAG, 0)) for t in tags]
        return KVBatchMeta(
            meta.partition,
            meta.task,
            list(meta.keys),
            fields=fields,
            sequence_lengths=lengths,
            tags=tags or None,
        )

    def get_data(self, meta: KVBatchMeta, select_fields: list[str] | None = None) -> TensorDict:
        """The rows of ``meta`` by key: ``select_fields``, else ``meta.fields``; never every
        field by default."""
        fields = select_fields if select_fields is not None else meta.fields
        if fields is None:
            raise InvalidRequestError(
                f"get_data of partition {meta.partition_id!r}: name the fields to read, with "
                f"select_fields=[...] or in meta.fields (it never reads every field)"
            )
        return self.get_samples(meta.sample_ids, meta.partition_id, list(fields))

    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        """Whether every task of ``task_names`` has claimed every row of the partition, by the
        controller's counts (every process's claims). False for a task the partition was not
        registered with."""
        tasks = check_names(task_names, "task_names", empty_ok=False)
        p = self.client.stats(partition_id).partitions[partition_id]
        registered = set(p.tasks_registered) - {HOLD_TASK}
        for task in tasks:
            if registered and task not in registered:
                return False
            state = p.tasks.get(task)
            if (p.rows if state is None else state.available) > 0:
                return False
        return True

    # --- (B) direct by key ---
    def put_samples(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: TensorDict | None = None,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write ``fields`` and merge ``tags`` into the rows of ``sample_ids`` (made if
        missing), atomically: on error nothing is written. Returns a meta of the rows with the
        field names written and the tags given."""
        ids = check_names(sample_ids, "sample_ids")
        if not ids:
            return KVBatchMeta(partition_id, None, [], fields=None)
        rows = put_tags(tags, len(ids))
        data = None if fields is None else put_fields(fields, self.config)
        names = [] if data is None else list(data.keys())
        if not names and rows is None:
            raise InvalidRequestError(
                f"put_samples to {partition_id!r} got neither fields nor tags: nothing to write"
            )
        version, groups = row_metadata(ids, rows, self.config)
        written = None
        if names and version is not None:
            try:  # new rows: a put, which also records the groups
                written = self.client.put(
                    data, partition_id, keys=ids, groups=groups, version=version,
                    versions_field=None, tags=rows,
                )  # fmt: skip
            except (DuplicateKeyError, GroupError):
                written = None  # some rows exist, or their group is complete: a keyed write
        if written is None:
            self.client.put_by_keys(
                partition_id, ids, data if names else None, tags=rows, version=version,
                versions_field=None,
            )  # fmt: skip
        return KVBatchMeta(
            partition_id,
            None,
            ids,
            fields=names or None,
            tags=None if rows is None else [dict(r) for r in rows],
        )

    def get_samples(
        self, sample_ids: list[str], partition_id: str, select_fields: list[str]
    ) -> TensorDict:
        """``select_fields`` of the rows of ``sample_ids``, in that order (batch size
        ``[len(sample_ids)]``): dense fields dense, ragged fields jagged (dense when every row
        has the same length), object fields as ``NonTensorStack``. Claims are untouched. A key,
        partition or field that does not exist, or a field not written for some row, raises a
        ``KeyError`` naming it."""
        ids = check_names(sample_ids, "sample_ids")
        fields = check_names(select_fields, "select_fields", empty_ok=False)
        if not ids:
            return TensorDict({}, batch_size=[0])
        try:
            meta = self.client.lookup(partition_id, ids, fields=fields)
        except NotReadyError as exc:
            raise NotProducedError(exc.message, **exc.details) from exc
        return densify(self.client.get_data(meta, fields))

    def clear_samples(self, sample_ids: list[str] | None, partition_id: str) -> None:
        """Delete the rows of ``sample_ids`` (keys not there are ignored), for every task.
        ``None``: delete the whole partition, its registration included (a ``RuntimeWarning``
        if it held no row)."""
        if sample_ids is None:
            try:
                rows = self.client.stats(partition_id).partitions[partition_id].rows
            except UnknownPartitionError:
                rows = 0
            self.client.clear_partition(partition_id)
            with self._lock:
                self._tasks.pop(partition_id, None)
                self._claims.pop(partition_id, None)
            if not rows:
                warnings.warn(
                    f"clear_samples(None, {partition_id!r}) found nothing to clear: the "
                    f"partition holds no rows",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        ids = list(dict.fromkeys(check_names(sample_ids, "sample_ids")))
        if not ids:
            return
        meta = self.client.lookup(partition_id, ids, missing_ok=True)
        if len(meta):
            self.client.clear_samples(meta)
        gone = set(ids)
        with self._lock:
            claims = self._claims.get(partition_id)
            if claims:
                claims[:] = [c for c in claims if not gone.issuperset(c.keys)]

    # --- (C) lifecycle ---
    def close(self) -> None:
        """Ack this client's claims (consumed for good), then close the connection and stop a
        cluster this client started. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            claims = [c for metas in self._claims.values() for c in metas]
            self._claims.clear()
        try:
            for meta in claims:
                # a lease that ended already (expired, cleared, cluster gone) gave its rows back
                with contextlib.suppress(TQStreamError):
                    self.client.ack(meta)
        finally:
            self._finalizer()

    # --- beyond the interface ---
    def list_sample_ids(self, partition_id: str) -> list[str]:
        """Keys of the partition's rows in put order ([] for a partition that does not exist)."""
        try:
            return self.client.list_keys(partition_id)
        except UnknownPartitionError:
            return []

    def _check_task(self, partition_id: str, task: str) -> None:
        if not isinstance(task, str) or not task:
            raise InvalidRequestError(f"task_name must be a non-empty str, got {task!r}")
        with self._lock:
            known = self._tasks.get(partition_id)
        if known is not None and (not known or task in known):
            return
        try:
            p = self.client.stats(partition_id).partitions[partition_id]
        except UnknownPartitionError as exc:
            raise UnknownPartitionError(
                f"claim_meta: partition {partition_id!r} does not exist; register_partition it "
                f"(claims then wait for its fields) or put_samples to it first",
                partition=partition_id,
            ) from exc
        known = frozenset(p.tasks_registered) - {HOLD_TASK}
        with self._lock:
            self._tasks[partition_id] = known
        if known and task not in known:
            raise UnknownTaskError(
                f"claim_meta: task {task!r} is not registered for partition {partition_id!r} "
                f"(registered: {sorted(known)}); pass it in register_partition(consumer_tasks=...)",
                partition=partition_id,
                task=task,
            )


def _release(client: Client | None, stop: Callable[[], None] | None) -> None:
    """Close what the data-plane client opened: its connection, then the cluster it started."""
    try:
        if client is not None:
            client.close()
    finally:
        if stop is not None:
            stop()
