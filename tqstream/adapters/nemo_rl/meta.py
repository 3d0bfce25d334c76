"""NeMo-RL's data-plane boundary types, for processes where ``nemo_rl`` is not importable.

``KVBatchMeta`` is the metadata NeMo-RL passes between its driver and workers: the partition, the
per-row string keys (``sample_ids``), the fields to read, per-row lengths for length-balanced
sharding, a batch-level ``extra_info`` bag and per-row ``tags``. Its transforms are pure (no I/O):
whoever drops a row from a working set clears it from the data plane.

``DataPlaneClient`` is NeMo-RL's abstract interface, method for method. When ``nemo_rl`` is
importable, :mod:`tqstream.adapters.nemo_rl` uses NeMo-RL's own two classes instead of these (see
``compat.py``), so its ``isinstance`` checks hold; these equivalents keep the adapter usable and
testable without NeMo-RL.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from tqstream.errors import InvalidRequestError

__all__ = ["DataPlaneClient", "KVBatchMeta"]


@dataclasses.dataclass
class KVBatchMeta:
    """Per-batch metadata of key-value rows: NeMo-RL's ``KVBatchMeta`` fields, in its order.

    ``fields`` is what to read (or what a put wrote), not the partition's schema; ``tags`` is
    aligned row for row with ``sample_ids`` when set. Not frozen: NeMo-RL stamps tags in place.
    """

    partition_id: str
    task_name: str | None
    sample_ids: list[str]
    fields: list[str] | None = None
    sequence_lengths: list[int] | None = None
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    tags: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.tags is not None and len(self.tags) != len(self.sample_ids):
            raise InvalidRequestError(
                f"KVBatchMeta: {len(self.tags)} tags for {len(self.sample_ids)} sample_ids; "
                f"tags must hold one dict per row (or be None)"
            )

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    def stamp_tags(self, scalars: dict[str, Sequence[Any]]) -> None:
        """Write ``scalars[name][i]`` into ``tags[i][name]`` for every row (in place); each
        sequence needs one value per row."""
        n = self.size
        for name, values in scalars.items():
            if len(values) != n:
                raise InvalidRequestError(
                    f"stamp_tags: {name!r} has {len(values)} values for {n} rows"
                )
        if self.tags is None:
            self.tags = [{} for _ in range(n)]
        for name, values in scalars.items():
            for row, value in zip(self.tags, values, strict=True):
                row[name] = value

    def _replace(
        self,
        *,
        sample_ids: list[str],
        sequence_lengths: list[int] | None,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """The same batch-level metadata (``fields`` shared, ``extra_info`` copied one level)
        over other rows."""
        return type(self)(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=list(sample_ids),
            fields=self.fields,
            sequence_lengths=None if sequence_lengths is None else list(sequence_lengths),
            extra_info=dict(self.extra_info),
            tags=None if tags is None else list(tags),
        )

    def _pick(self, rows: Sequence[int]) -> KVBatchMeta:
        lengths, tags = self.sequence_lengths, self.tags
        return self._replace(
            sample_ids=[self.sample_ids[i] for i in rows],
            sequence_lengths=None if lengths is None else [lengths[i] for i in rows],
            tags=None if tags is None else [tags[i] for i in rows],
        )

    def subset(self, indices: Sequence[int]) -> KVBatchMeta:
        """The rows at ``indices``, in that order (tag dicts shared, not copied)."""
        return self._pick(list(indices))

    def slice(self, start: int, stop: int) -> KVBatchMeta:
        """The rows ``start`` to ``stop - 1``."""
        return self._pick(range(self.size)[start:stop])

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """These rows then ``others``' rows (same partition); lengths and tags survive only if
        every part has them."""
        parts = (self, *others)
        foreign = {o.partition_id for o in others} - {self.partition_id}
        if foreign:
            raise InvalidRequestError(
                f"KVBatchMeta.concat: every part must be of partition {self.partition_id!r}, "
                f"got {sorted(foreign)}"
            )
        lengths = [m.sequence_lengths for m in parts]
        tags = [m.tags for m in parts]
        return self._replace(
            sample_ids=[k for m in parts for k in m.sample_ids],
            sequence_lengths=None
            if any(x is None for x in lengths)
            else [n for x in lengths for n in x or ()],
            tags=None if any(t is None for t in tags) else [d for t in tags for d in t or ()],
        )

    def drop(self, indices: Sequence[int]) -> KVBatchMeta | None:
        """Every row but those at ``indices``; None when no row is left."""
        gone = set(indices)
        keep = [i for i in range(self.size) if i not in gone]
        return self._pick(keep) if keep else None

    def with_fields(self, field_names: Sequence[str]) -> KVBatchMeta:
        """A copy whose ``fields`` also name ``field_names`` (order kept, no duplicates); tags
        are deep-copied so the copy can be stamped independently."""
        out = self._replace(
            sample_ids=self.sample_ids,
            sequence_lengths=self.sequence_lengths,
            tags=None if self.tags is None else copy.deepcopy(self.tags),
        )
        out.fields = list(dict.fromkeys([*(self.fields or ()), *field_names]))
        return out


class DataPlaneClient(abc.ABC):
    """NeMo-RL's data-plane interface: (A) task-mediated reads through per-task claims,
    (B) direct reads and writes by key, (C) lifecycle. Writing a field is the "stage done"
    signal: a claim waits until every required field of a row is written."""

    @abc.abstractmethod
    def register_partition(
        self,
        partition_id: str,
        fields: list[str],
        num_samples: int,
        consumer_tasks: list[str],
        grpo_group_size: int | None = None,
        enums: dict[str, list[str]] | None = None,
    ) -> None: ...

    @abc.abstractmethod
    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: list[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta: ...

    @abc.abstractmethod
    def get_data(self, meta: KVBatchMeta, select_fields: list[str] | None = None) -> TensorDict: ...

    @abc.abstractmethod
    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool: ...

    @abc.abstractmethod
    def put_samples(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: TensorDict | None = None,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta: ...

    @abc.abstractmethod
    def get_samples(
        self, sample_ids: list[str], partition_id: str, select_fields: list[str]
    ) -> TensorDict: ...

    @abc.abstractmethod
    def clear_samples(self, sample_ids: list[str] | None, partition_id: str) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...
