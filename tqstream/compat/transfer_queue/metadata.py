"""Batch metadata with TransferQueue 0.1.11's public contract, for the tqstream backend of its API.

Code written against TransferQueue (verl 0.9.1 above all) never touches rows directly: it passes
``BatchMeta`` / ``KVBatchMeta`` objects between workers, pickles them through Ray, slices, chunks,
concatenates and merges them, and reads their columns. For that code to run on tqstream unchanged,
the backend must hand out objects that behave exactly like TransferQueue 0.1.11's, as pinned down
by its ``tests/test_metadata.py`` and by verl's use. This module is that contract, written for
tqstream; it does not import TransferQueue.

A ``BatchMeta`` is columnar: every per-sample column (``global_indexes``, ``partition_ids``,
``production_status``, ``custom_meta``, ``_custom_backend_meta``, the ``per_sample_shapes`` of
ragged fields and ``_placement``) has one entry per sample, in batch order, and every operation
keeps them aligned. Two private slots exist only here:

``_cluster``
    The token of the tqstream cluster that produced the object, ``None`` when the user built it.
``_placement``
    Per sample, ``(storage unit index, replica unit index or -1, generation)`` of the row in that
    cluster (the generation: its partition's incarnation, which the units check at a read), or
    ``None`` when unknown. It lets the backend read and write rows on the storage units directly,
    without asking the controller where they live. It is a hint, to be trusted only when
    ``_cluster`` names the cluster the backend talks to; when it is ``None`` (or the cluster
    differs), the backend asks the controller.

Both survive every operation that builds or reorders a batch, and pickling. The module holds no
I/O (no logging either): TransferQueue's warnings for odd-but-legal calls (concatenating batches
whose ``extra_info`` keys differ, asking for more chunks than samples) are silent here. Errors are
the builtin exceptions TransferQueue raises, since that is what its callers catch.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["BatchMeta", "KVBatchMeta", "extract_field_schema"]

FieldMeta = dict[str, Any]
"""One field's schema: ``dtype``, ``shape``, ``is_nested``, ``is_non_tensor`` and, for ragged
(nested) fields, ``per_sample_shapes``."""

Placement = tuple[int, int, int]
"""``(storage unit index, replica unit index or -1, generation)`` of one row in a tqstream
cluster."""

_READY = 1  # production_status of a sample whose fields are all written; 0 means not yet


def _values_equal(a: Any, b: Any) -> bool:
    """Whether two ``extra_info`` values agree; tensors and arrays compare as a whole."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # containers of tensors and the like: not provably equal
        return False


def _merge_extra_info(infos: Iterable[Mapping[str, Any]], owner: str) -> dict[str, Any]:
    """The union of batch-level infos, in first-seen key order; a key seen twice must agree."""
    merged: dict[str, Any] = {}
    first_seen: dict[str, int] = {}
    for position, info in enumerate(infos):
        for key, value in info.items():
            if key not in merged:
                merged[key] = value
                first_seen[key] = position
            elif not _values_equal(merged[key], value):
                raise ValueError(
                    f"{owner}.concat: extra_info key {key!r} has conflicting values across the "
                    f"inputs (input {first_seen[key]}: {merged[key]!r}, input {position}: "
                    f"{value!r}); make them equal or drop the key before concatenating"
                )
    return merged


def _chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``chunks`` contiguous pieces; the first ``size % chunks`` pieces
    hold one sample more, and pieces past the last sample are empty."""
    if chunks < 1:
        raise ValueError(f"chunk() needs chunks >= 1, got {chunks}")
    base, extra = divmod(size, chunks)
    bounds = []
    start = 0
    for piece in range(chunks):
        stop = start + base + (1 if piece < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _check_rows(field: str, rows: int, batch_size: int) -> None:
    if rows != batch_size:
        raise ValueError(
            f"field {field!r} has {rows} rows but the TensorDict's batch size is {batch_size}"
        )


def extract_field_schema(data: TensorDict) -> dict[str, FieldMeta]:
    """The per-field schema of a batch of rows, as :attr:`BatchMeta.field_schema` holds it.

    A dense tensor field records the shape of one row (a 1-D field counts as rows of shape
    ``(1,)``); a nested (ragged) field also records every row's shape; any other value is a
    non-tensor field with neither dtype nor shape. An empty batch has no schema.
    """
    batch_size = data.batch_size[0]
    schema: dict[str, FieldMeta] = {}
    if batch_size == 0:
        return schema
    for name, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = value.unbind()
            _check_rows(name, len(rows), batch_size)
            schema[name] = {
                "dtype": rows[0].dtype,
                "shape": rows[0].shape,
                "is_nested": True,
                "is_non_tensor": False,
                "per_sample_shapes": [tuple(row.shape) for row in rows],
            }
        elif isinstance(value, torch.Tensor):
            _check_rows(name, value.shape[0], batch_size)
            row_shape = value.shape[1:] if value.dim() > 1 else torch.Size([1])
            schema[name] = {
                "dtype": value.dtype,
                "shape": row_shape,
                "is_nested": False,
                "is_non_tensor": False,
            }
        else:
            _check_rows(name, len(value), batch_size)
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


def _own_rows(rows: Sequence[Mapping[str, Any]] | None, size: int, name: str) -> list[dict]:
    """Per-sample dicts owned by the batch; fresh empty ones when none (or an empty list) given."""
    if not rows:
        return [{} for _ in range(size)]
    owned = [dict(row) for row in rows]
    if len(owned) != size:
        raise ValueError(f"{name} has {len(owned)} entries but the batch has {size} samples")
    return owned


def _own_placement(placement: Iterable[Sequence[int]], size: int) -> list[Placement]:
    rows = [(int(unit), int(replica), int(generation)) for unit, replica, generation in placement]
    if len(rows) != size:
        raise ValueError(f"_placement has {len(rows)} entries but the batch has {size} samples")
    return rows


def _shared_strings(values: Iterable[str]) -> list[str]:
    """The values with equal strings made one object, so a pickle stores each distinct id once."""
    seen: dict[str, str] = {}
    return [seen.setdefault(value, value) for value in values]


class BatchMeta:
    """Metadata of a batch of samples: where they are and what fields they have, not their data.

    Mirrors TransferQueue 0.1.11's public ``BatchMeta``. ``field_schema`` maps field names to
    :data:`FieldMeta`; ``production_status`` is an ``int8`` array, 1 for a sample whose fields are
    written; ``extra_info`` is batch-level, ``custom_meta`` per sample for the user, and
    ``_custom_backend_meta`` per sample for the storage backend. The constructor copies what it
    is given (lists, dicts one level deep), so later changes by the caller do not leak in.
    """

    __slots__ = (
        "_cluster",
        "_custom_backend_meta",
        "_placement",
        "custom_meta",
        "extra_info",
        "field_schema",
        "global_indexes",
        "partition_ids",
        "production_status",
    )

    global_indexes: list[int]
    partition_ids: list[str]
    field_schema: dict[str, FieldMeta]
    production_status: np.ndarray
    extra_info: dict[str, Any]
    custom_meta: list[dict[str, Any]]
    _custom_backend_meta: list[dict[str, Any]]
    _cluster: str | None
    _placement: list[Placement] | None

    def __init__(
        self,
        global_indexes: Sequence[int] | None = None,
        partition_ids: Sequence[str] | None = None,
        field_schema: Mapping[str, Mapping[str, Any]] | None = None,
        production_status: np.ndarray | Sequence[int] | None = None,
        extra_info: Mapping[str, Any] | None = None,
        custom_meta: Sequence[Mapping[str, Any]] | None = None,
        _custom_backend_meta: Sequence[Mapping[str, Any]] | None = None,
        *,
        _cluster: str | None = None,
        _placement: Iterable[Sequence[int]] | None = None,
    ) -> None:
        indexes = list(global_indexes) if global_indexes is not None else []
        partitions = _shared_strings(partition_ids) if partition_ids is not None else []
        size = len(indexes)
        if len(partitions) != size:
            raise ValueError(
                f"Length mismatch: global_indexes has {size} entries, "
                f"partition_ids has {len(partitions)}"
            )
        if production_status is None:
            status = np.zeros(size, dtype=np.int8)
        else:
            status = np.array(production_status, dtype=np.int8, copy=True)
            if len(status) != size:
                raise ValueError(
                    f"production_status has {len(status)} entries but the batch has {size} samples"
                )
        schema = {name: dict(meta) for name, meta in (field_schema or {}).items()}
        for name, meta in schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != size:
                raise ValueError(
                    f"field {name!r} has {len(shapes)} per_sample_shapes "
                    f"but the batch has {size} samples"
                )
        self.global_indexes = indexes
        self.partition_ids = partitions
        self.field_schema = schema
        self.production_status = status
        self.extra_info = dict(extra_info or {})
        self.custom_meta = _own_rows(custom_meta, size, "custom_meta")
        self._custom_backend_meta = _own_rows(_custom_backend_meta, size, "_custom_backend_meta")
        self._cluster = _cluster
        self._placement = None if _placement is None else _own_placement(_placement, size)

    @classmethod
    def _assemble(
        cls,
        global_indexes: list[int],
        partition_ids: list[str],
        field_schema: dict[str, FieldMeta],
        production_status: np.ndarray,
        extra_info: dict[str, Any],
        custom_meta: list[dict[str, Any]],
        backend_meta: list[dict[str, Any]],
        cluster: str | None,
        placement: list[Placement] | None,
    ) -> BatchMeta:
        """A batch over columns built for it alone and already aligned: no copies, no checks."""
        batch = cls.__new__(cls)
        batch.global_indexes = global_indexes
        batch.partition_ids = partition_ids
        batch.field_schema = field_schema
        batch.production_status = production_status
        batch.extra_info = extra_info
        batch.custom_meta = custom_meta
        batch._custom_backend_meta = backend_meta
        batch._cluster = cluster
        batch._placement = placement
        return batch

    # The pickled state is every slot's value in __slots__ order (the two tqstream slots
    # included), so Ray, pickle and copy.deepcopy round-trip the whole object.
    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, slot) for slot in self.__slots__)

    def __setstate__(self, state: Sequence[Any]) -> None:
        for slot, value in zip(self.__slots__, state, strict=True):
            setattr(self, slot, value)
        # Ray's zero-copy deserialisation (pickle protocol 5 buffers) yields read-only arrays,
        # and add_fields writes production_status in place.
        if not self.production_status.flags.writeable:
            self.production_status = self.production_status.copy()

    # ---- views ----

    @property
    def size(self) -> int:
        """The number of samples."""
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        """The field names, sorted."""
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        """Whether the batch has samples and every one of them is fully written."""
        return self.size > 0 and bool(np.all(self.production_status == _READY))

    @property
    def samples(self) -> _SampleViewList:
        """Read-only, lazily built per-sample views: ``samples[i].fields['x']['shape']``."""
        return _SampleViewList(self)

    def __len__(self) -> int:
        return self.size

    def get_dtypes(self, field_name: str) -> list[Any]:
        """The field's dtype once per sample (a field has one dtype)."""
        return [self._field(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        """The field's row shape per sample: each row's own for a ragged field."""
        meta = self._field(field_name)
        shapes = meta.get("per_sample_shapes")
        if shapes is not None:
            return list(shapes)
        return [meta.get("shape")] * self.size

    def _field(self, field_name: str) -> FieldMeta:
        try:
            return self.field_schema[field_name]
        except KeyError:
            raise KeyError(
                f"field {field_name!r} is not in this batch; its fields are {self.field_names}"
            ) from None

    # ---- batch-level extra_info ----

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        """A deep copy: changing it leaves the batch alone."""
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: Mapping[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        """Remove ``key`` and return its value (``None`` when absent)."""
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # ---- per-sample custom_meta ----

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of the per-sample dicts, in batch order."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[Mapping[str, Any]] | None) -> None:
        """Merge one dict per sample (in batch order) into each sample's custom_meta."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"update_custom_meta got {len(custom_meta)} dicts but the batch has "
                f"{self.size} samples; pass exactly one per sample"
            )
        for row, update in zip(self.custom_meta, custom_meta, strict=True):
            row.update(update)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # ---- in-place changes ----

    def add_fields(self, tensor_dict: TensorDict, set_all_ready: bool = True) -> BatchMeta:
        """Record the fields of ``tensor_dict`` (one row per sample) and, by default, mark every
        sample ready. Changes this batch and returns it; an empty TensorDict changes nothing."""
        rows = tensor_dict.batch_size[0]
        if rows == 0:
            return self
        if rows != self.size:
            raise ValueError(
                f"add_fields batch size mismatch: the batch has {self.size} samples, "
                f"the TensorDict {rows} rows"
            )
        self.field_schema.update(extract_field_schema(tensor_dict))
        if set_all_ready:
            self.production_status[:] = _READY
        return self

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in the order ``indices`` gives (a permutation of the positions)."""
        order = [operator.index(i) for i in indices]
        size = self.size
        if len(order) != size:
            raise ValueError(f"reorder got {len(order)} indices for a batch of {size} samples")
        if len(set(order)) != size:
            raise ValueError("reorder indices contain duplicates")
        if any(not 0 <= i < size for i in order):
            raise ValueError(f"reorder indices must be in range [0, {size})")
        self.global_indexes = [self.global_indexes[i] for i in order]
        self.partition_ids = [self.partition_ids[i] for i in order]
        self.production_status = self.production_status[order]
        for meta in self.field_schema.values():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                meta["per_sample_shapes"] = [shapes[i] for i in order]
        self.custom_meta = [self.custom_meta[i] for i in order]
        self._custom_backend_meta = [self._custom_backend_meta[i] for i in order]
        if self._placement is not None:
            self._placement = [self._placement[i] for i in order]

    # ---- new batches from this one ----

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """A new batch of the samples at these positions, in this order (repeats allowed)."""
        picked = [operator.index(i) for i in sample_indices]
        size = self.size
        if any(not 0 <= i < size for i in picked):
            raise ValueError(f"Sample indices must be in range [0, {size})")
        schema: dict[str, FieldMeta] = {}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is None:
                schema[name] = copy.deepcopy(meta)
            else:
                rest = copy.deepcopy({k: v for k, v in meta.items() if k != "per_sample_shapes"})
                schema[name] = {**rest, "per_sample_shapes": [shapes[i] for i in picked]}
        placement = self._placement
        return self._assemble(
            global_indexes=[self.global_indexes[i] for i in picked],
            partition_ids=[self.partition_ids[i] for i in picked],
            field_schema=schema,
            production_status=self.production_status[picked].astype(np.int8),
            extra_info=dict(self.extra_info),
            custom_meta=[copy.deepcopy(self.custom_meta[i]) for i in picked],
            backend_meta=[copy.deepcopy(self._custom_backend_meta[i]) for i in picked],
            cluster=self._cluster,
            placement=None if placement is None else [placement[i] for i in picked],
        )

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """A new batch of all samples with only the named fields (names not present are skipped).

        Backend metadata keeps the entries of the selected fields and the private ones (keys
        starting with ``_``)."""
        keep = set(field_names)
        schema = {
            name: copy.deepcopy(self.field_schema[name])
            for name in field_names
            if name in self.field_schema
        }
        backend = [
            {key: value for key, value in row.items() if key.startswith("_") or key in keep}
            for row in self._custom_backend_meta
        ]
        return self._assemble(
            global_indexes=list(self.global_indexes),
            partition_ids=list(self.partition_ids),
            field_schema=schema,
            production_status=self.production_status.copy(),
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=copy.deepcopy(self.custom_meta),
            backend_meta=backend,
            cluster=self._cluster,
            placement=None if self._placement is None else list(self._placement),
        )

    def copy(self) -> BatchMeta:
        """A deep copy."""
        return self._assemble(
            global_indexes=list(self.global_indexes),
            partition_ids=list(self.partition_ids),
            field_schema=copy.deepcopy(self.field_schema),
            production_status=self.production_status.copy(),
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=copy.deepcopy(self.custom_meta),
            backend_meta=copy.deepcopy(self._custom_backend_meta),
            cluster=self._cluster,
            placement=None if self._placement is None else list(self._placement),
        )

    def __getitem__(self, item: int | np.integer | slice) -> BatchMeta:
        """A one-sample batch for an integer (negative counts from the end), a batch for a slice."""
        if isinstance(item, slice):
            return self.select_samples(range(*item.indices(self.size)))
        if isinstance(item, int | np.integer):
            position = int(item)
            if position < 0:
                position += self.size
            if not 0 <= position < self.size:
                raise IndexError(f"BatchMeta index {item} out of range for {self.size} samples")
            return self.select_samples([position])
        raise TypeError(f"BatchMeta indices must be integers or slices, not {type(item).__name__}")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` contiguous batches, the first ``size % chunks`` one sample larger; empty
        batches at the end when there are fewer samples than chunks."""
        return [self.select_samples(range(a, b)) for a, b in _chunk_bounds(self.size, chunks)]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One batch per partition id, in order of first appearance, samples in batch order."""
        groups: dict[str, list[int]] = {}
        for position, partition in enumerate(self.partition_ids):
            groups.setdefault(partition, []).append(position)
        return [self.select_samples(positions) for positions in groups.values()]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """A new batch of the same samples with the fields of both (``other`` wins a clash).

        Both batches must list the same samples in the same order. A sample is ready only when it
        is ready on both sides; custom and backend metadata merge per sample, ``other`` winning.
        With one side empty the result is a copy of the other."""
        if other is None or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes:
            raise ValueError(
                f"BatchMeta.union: global_indexes do not match: "
                f"{self.global_indexes} vs {other.global_indexes}"
            )
        if self.partition_ids != other.partition_ids:
            raise ValueError(
                f"BatchMeta.union: partition_ids do not match: "
                f"{self.partition_ids} vs {other.partition_ids}"
            )
        schema = copy.deepcopy(self.field_schema)
        schema.update(copy.deepcopy(other.field_schema))
        status = np.bitwise_and(self.production_status, other.production_status)
        placement = self._placement if self._placement is not None else other._placement
        return self._assemble(
            global_indexes=list(self.global_indexes),
            partition_ids=list(self.partition_ids),
            field_schema=schema,
            production_status=status.astype(np.int8, copy=False),
            extra_info={**self.extra_info, **other.extra_info},
            custom_meta=[
                {**copy.deepcopy(mine), **copy.deepcopy(theirs)}
                for mine, theirs in zip(self.custom_meta, other.custom_meta, strict=True)
            ],
            backend_meta=[
                {**copy.deepcopy(mine), **copy.deepcopy(theirs)}
                for mine, theirs in zip(
                    self._custom_backend_meta, other._custom_backend_meta, strict=True
                )
            ],
            cluster=self._cluster if self._cluster == other._cluster else None,
            placement=None if placement is None else list(placement),
        )

    @classmethod
    def concat(cls, data: Sequence[BatchMeta | None], validate: bool = True) -> BatchMeta:
        """One batch of the samples of all inputs, in order; empty inputs are skipped.

        With ``validate``, every input must have the same fields with the same dtypes. The schema
        is the first input's; a field ragged in any input is ragged in the result. ``extra_info``
        is the union of the inputs' and must agree on shared keys. ``_cluster`` survives when all
        non-empty inputs share it, ``_placement`` when all of them have one."""
        parts = [batch for batch in data if batch is not None and batch.size > 0]
        if not parts:
            return cls.empty()
        first = parts[0]
        if validate:
            names = first.field_names
            for position, part in enumerate(parts):
                if part.field_names != names:
                    raise ValueError(
                        f"BatchMeta.concat: field_names mismatch at chunk[{position}]: expected "
                        f"{names}, got {part.field_names}"
                    )
            for name in names:
                dtype = first.field_schema[name].get("dtype")
                for position, part in enumerate(parts):
                    if part.field_schema[name].get("dtype") != dtype:
                        raise ValueError(
                            f"Field {name!r} dtype mismatch in concat: chunk[0] has {dtype}, "
                            f"chunk[{position}] has {part.field_schema[name].get('dtype')}"
                        )
        schema = {
            name: cls._concat_field(name, meta, parts) for name, meta in first.field_schema.items()
        }
        cluster = first._cluster if all(p._cluster == first._cluster for p in parts) else None
        placement: list[Placement] | None = None
        if all(part._placement is not None for part in parts):
            placement = [row for part in parts for row in part._placement or ()]
        return cls._assemble(
            global_indexes=[index for part in parts for index in part.global_indexes],
            partition_ids=[partition for part in parts for partition in part.partition_ids],
            field_schema=schema,
            production_status=np.concatenate([p.production_status for p in parts]).astype(np.int8),
            extra_info=_merge_extra_info((part.extra_info for part in parts), "BatchMeta"),
            custom_meta=[dict(row) for part in parts for row in part.custom_meta],
            backend_meta=[dict(row) for part in parts for row in part._custom_backend_meta],
            cluster=cluster,
            placement=placement,
        )

    @staticmethod
    def _concat_field(name: str, meta: Mapping[str, Any], parts: Sequence[BatchMeta]) -> FieldMeta:
        metas = [part.field_schema.get(name, {}) for part in parts]
        nested = any(m.get("is_nested", False) for m in metas)
        merged = copy.deepcopy({k: v for k, v in meta.items() if k != "per_sample_shapes"})
        merged.update(
            dtype=meta.get("dtype"),
            shape=None if nested else meta.get("shape"),
            is_nested=nested,
            is_non_tensor=meta.get("is_non_tensor", False),
        )
        if nested or any(m.get("per_sample_shapes") for m in metas):
            shapes: list[Any] = []
            for part, part_meta in zip(parts, metas, strict=True):
                own = part_meta.get("per_sample_shapes")
                shapes.extend(own if own else [part_meta.get("shape")] * part.size)
            merged["per_sample_shapes"] = shapes
        return merged

    @classmethod
    def empty(cls, extra_info: Mapping[str, Any] | None = None) -> BatchMeta:
        """A batch of no samples, carrying ``extra_info``."""
        return cls(global_indexes=[], partition_ids=[], extra_info=extra_info)

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
            f"extra_info={self.extra_info})"
        )

    __repr__ = __str__


class _SampleView:
    """One sample of a batch, read from the batch's columns on access; its mappings are read-only.

    It holds the batch and a position, so it sees later in-place changes to the batch (and is
    meaningless after a reorder)."""

    __slots__ = ("_batch", "_position")

    def __init__(self, batch: BatchMeta, position: int) -> None:
        self._batch = batch
        self._position = position

    @property
    def global_index(self) -> int:
        return self._batch.global_indexes[self._position]

    @property
    def partition_id(self) -> str:
        return self._batch.partition_ids[self._position]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._position])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._batch.custom_meta[self._position])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        """Each field's schema for this sample: a ragged field shows this row's ``shape`` instead
        of the batch's ``per_sample_shapes``."""
        fields: dict[str, MappingProxyType[str, Any]] = {}
        for name, meta in self._batch.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is None:
                fields[name] = MappingProxyType(dict(meta))
            else:
                own = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
                own["shape"] = shapes[self._position]
                fields[name] = MappingProxyType(own)
        return MappingProxyType(fields)

    def __repr__(self) -> str:
        return (
            f"_SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"production_status={self.production_status}, "
            f"fields={list(self._batch.field_schema)})"
        )


class _SampleViewList:
    """The samples of a batch as a read-only sequence of :class:`_SampleView`, built on access."""

    __slots__ = ("_batch",)

    def __init__(self, batch: BatchMeta) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, index: int) -> _SampleView:
        position = operator.index(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        return _SampleView(self._batch, position)

    def __iter__(self) -> Iterator[_SampleView]:
        return (_SampleView(self._batch, position) for position in range(len(self)))


_SCALARS = (str, int, float, bool, type(None))


def _copy_tag(tag: Any) -> Any:
    """A deep copy of one sample's tags: a comprehension for the usual flat dict of scalars (and
    lists of scalars), ``copy.deepcopy`` (far slower, ~40 µs a dict) for anything else."""
    if type(tag) is dict:
        out: dict[Any, Any] = {}
        for key, value in tag.items():
            if isinstance(value, _SCALARS):
                out[key] = value
            elif type(value) is list and all(isinstance(v, _SCALARS) for v in value):
                out[key] = list(value)
            else:
                return copy.deepcopy(tag)
        return out
    return copy.deepcopy(tag)


@dataclasses.dataclass
class KVBatchMeta:
    """Metadata of a batch addressed by user keys (TransferQueue's key-value interface).

    Mirrors TransferQueue 0.1.11's public ``KVBatchMeta``: ``keys`` (unique) and ``tags`` (one
    dict per key) are per sample; ``partition_id``, ``fields`` (unique names, ``None`` for all)
    and ``extra_info`` are batch-level. ``tags`` and ``extra_info`` are deep-copied on
    construction, so chunks and concatenations never share them with their source.
    """

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(
                f"keys and tags must have same length, but got {len(self.keys)} keys and "
                f"{len(self.tags)} tags"
            )
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"Got duplicated keys in {self.keys}")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError(f"Got duplicated fields in {self.fields}")
        self.keys = list(self.keys)
        self.tags = [_copy_tag(tag) for tag in self.tags]
        self.extra_info = copy.deepcopy(self.extra_info)

    @classmethod
    def _issued(
        cls, keys: list[str], tags: list[dict[str, Any]], partition_id: str, fields: list[str]
    ) -> KVBatchMeta:
        """Metadata the backend builds from what the cluster answered: keys unique, tags and
        lists decoded for this call, so nothing to check or copy (a copy of 256 tag dicts costs
        more than the request that returned them)."""
        meta = cls.__new__(cls)
        meta.keys, meta.tags, meta.partition_id = keys, tags, partition_id
        meta.fields, meta.extra_info = fields, {}
        return meta

    @property
    def size(self) -> int:
        """The number of samples."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, field_names={self.fields}, "
            f"extra_info={self.extra_info})"
        )

    def _with_samples(self, keys: list[str], tags: list[dict[str, Any]]) -> KVBatchMeta:
        return type(self)(
            keys=keys,
            tags=tags,
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """A new batch of these keys, in this order."""
        wanted = list(keys_to_select)
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"select_keys: Contain duplicate keys in {wanted}")
        position = {key: i for i, key in enumerate(self.keys)}
        missing = [key for key in wanted if key not in position]
        if missing:
            raise RuntimeError(f"select_keys: keys {missing} not found in current batch")
        return self._with_samples(wanted, [self.tags[position[key]] for key in wanted])

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the samples in the order ``indexes`` gives (a permutation of the positions)."""
        order = [operator.index(i) for i in indexes]
        if len(order) != self.size:
            raise ValueError(
                f"reorder got {len(order)} indexes, which does not match the batch size {self.size}"
            )
        if len(set(order)) != len(order):
            raise ValueError("reorder: Contain duplicate indexes")
        if any(not 0 <= i < self.size for i in order):
            raise IndexError(f"reorder indexes must be in range [0, {self.size})")
        self.keys = [self.keys[i] for i in order]
        self.tags = [self.tags[i] for i in order]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """``chunks`` contiguous batches, the first ``size % chunks`` one sample larger; empty
        batches at the end when there are fewer samples than chunks."""
        return [
            self._with_samples(self.keys[a:b], self.tags[a:b])
            for a, b in _chunk_bounds(self.size, chunks)
        ]

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta | None]) -> KVBatchMeta:
        """One batch of the samples of all inputs, in order; empty inputs are skipped.

        The inputs must share the partition id and (where given) the field set; ``extra_info`` is
        the union of theirs and must agree on shared keys."""
        parts = [batch for batch in data if batch is not None and batch.size > 0]
        if not parts:
            return cls()
        first = parts[0]
        base_fields = set(first.fields or ())
        for part in parts:
            if part.fields is not None and set(part.fields) != base_fields:
                raise ValueError(
                    f"Field names do not match for concatenation: {first.fields} vs {part.fields}"
                )
            if part.partition_id != first.partition_id:
                raise ValueError(
                    f"Partition do not match for concatenation: {first.partition_id!r} vs "
                    f"{part.partition_id!r}"
                )
        return cls(
            keys=[key for part in parts for key in part.keys],
            tags=[tag for part in parts for tag in part.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=_merge_extra_info((part.extra_info or {} for part in parts), "KVBatchMeta"),
        )
