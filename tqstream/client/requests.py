"""What the client builds in the caller's thread, apart from its I/O: user data encoded into
columns and a put request, the requests of gets, partitions and checkpoints, and fetched columns
decoded into a TensorDict (``client.py`` sends and receives them on its IO thread or lanes)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch
from tensordict import TensorDict

from tqstream.client.batch import Window
from tqstream.client.core import GET_GRACE
from tqstream.client.versions import row_versions
from tqstream.errors import BatchShapeError, InvalidRequestError
from tqstream.protocol.codec import Column, columns_from_data, to_tensordict
from tqstream.protocol.messages import (
    CreatePartition,
    GetMeta,
    LoadCheckpoint,
    PreparePut,
    SaveCheckpoint,
)
from tqstream.types import BatchMeta

PadValues = float | Mapping[str, float]


def encode_put(
    data: Any,
    partition: str,
    keys: Sequence[str] | None,
    groups: Sequence[Any] | None,
    group_size: int | None,
    version: int | None,
    dispatch_version: int | Sequence[int | None] | None,
    versions_field: str | None,
    reject_mixed_versions: bool,
    timeout: float | None,
) -> tuple[PreparePut, dict[str, Column]]:
    """Encode the batch into columns and the prepare request (in the caller's thread)."""
    n, columns = columns_from_data(data)
    for name, seq in (("keys", keys), ("groups", groups)):
        if seq is not None and len(seq) != n:
            raise BatchShapeError(
                f"{name}= has {len(seq)} entries but the data has {n} rows", rows=n
            )
    if keys is not None:
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise InvalidRequestError(
                f"keys must be strings, got {type(bad[0]).__name__} {bad[0]!r}"
            )
        keys = list(keys)
    if groups is not None:
        groups = [None if g is None else str(g) for g in groups]
    dispatch: list[int | None] | None = None
    if isinstance(dispatch_version, int):
        dispatch = [dispatch_version] * n
    elif dispatch_version is not None:
        dispatch = list(dispatch_version)
        if len(dispatch) != n:
            raise BatchShapeError(
                f"dispatch_version= has {len(dispatch)} entries but the data has {n} rows",
                rows=n,
            )
    starts = ends = None
    if versions_field is not None and versions_field in columns:
        starts, ends = row_versions(versions_field, columns[versions_field], version)
    rejected = 0
    if reject_mixed_versions:
        if starts is None or ends is None:
            where = (
                "a per-token versions field, but versions_field=None"
                if versions_field is None
                else f"the per-token versions field {versions_field!r} in the data (or name "
                f"it with versions_field=)"
            )
            raise InvalidRequestError(f"reject_mixed_versions=True needs {where}")
        keep = [i for i in range(n) if starts[i] == ends[i]]
        rejected = n - len(keep)
        if rejected:
            index = torch.tensor(keep, dtype=torch.int64)
            columns = {k: c.take(index) for k, c in columns.items()}
            pick = lambda seq: None if seq is None else [seq[i] for i in keep]  # noqa: E731
            keys, groups, dispatch = pick(keys), pick(groups), pick(dispatch)
            starts, ends = pick(starts), pick(ends)
            n = len(keep)
    req = PreparePut(
        rid=0,
        partition=partition,
        n_rows=n,
        schemas={k: c.schema for k, c in columns.items()},
        nbytes=sum(c.nbytes for c in columns.values()),
        keys=keys,
        groups=groups,
        group_size=group_size,
        version=version,
        version_start=starts,
        version_end=ends,
        dispatch_version=dispatch,
        rejected=rejected,
        timeout=timeout,
    )
    return req, columns


def encode_fields(meta: BatchMeta, data: Any) -> dict[str, Column]:
    n, columns = columns_from_data(data)
    if n != len(meta):
        raise BatchShapeError(
            f"put_fields got {n} rows of data for a batch of {len(meta)} "
            f"rows; pass one row per row of the BatchMeta, in its order",
            rows=n,
            expected=len(meta),
        )
    return columns


def get_request(
    partition: str,
    fields: Sequence[str] | str,
    batch_size: int,
    task: str,
    whole_groups: bool,
    lease_timeout: float | None,
    timeout: float | None,
    window: Window,
) -> GetMeta:
    if isinstance(fields, str):
        fields = [fields]
    return GetMeta(
        rid=0,
        partition=partition,
        fields=list(fields),
        batch_size=batch_size,
        task=task,
        whole_groups=whole_groups,
        lease_timeout=lease_timeout,
        timeout=timeout,
        current_version=window.current_version,
        max_staleness=window.max_staleness,
        measure=window.measure,
        on_stale=window.on_stale,
    )


def partition_message(
    partition: str,
    fields: Sequence[str],
    tasks: Sequence[str] | None,
    ttl: float | None,
    admission: str | None,
    producers: int | None,
    replicas: int | None = None,
) -> CreatePartition:
    return CreatePartition(
        rid=0,
        partition=partition,
        fields=list(fields),
        tasks=None if tasks is None else list(tasks),
        ttl=ttl,
        admission=admission,
        producers=producers,
        replicas=replicas,
    )


def checkpoint_message(
    kind: type[SaveCheckpoint] | type[LoadCheckpoint],
    path: str | os.PathLike[str],
    timeout: float | None,
    metadata: Mapping[str, Any] | None = None,
) -> SaveCheckpoint | LoadCheckpoint:
    where = os.path.abspath(os.fspath(path))
    if kind is LoadCheckpoint:
        return LoadCheckpoint(rid=0, path=where, timeout=timeout)
    raw = b""
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise InvalidRequestError(
                f"checkpoint metadata must be a mapping (a JSON object), got "
                f"{type(metadata).__name__}"
            )
        try:
            raw = msgspec.json.encode(dict(metadata))
        except (TypeError, msgspec.EncodeError) as exc:
            raise InvalidRequestError(
                f"checkpoint metadata must be JSON values (str, numbers, bools, None, lists, "
                f"dicts with str keys): {exc}"
            ) from None
    return SaveCheckpoint(rid=0, path=where, metadata=raw, timeout=timeout)


def reply_wait(timeout: float | None) -> float | None:
    """How long the client waits for a checkpoint's reply: the units' time and a margin."""
    return None if timeout is None else timeout + GET_GRACE


def decode(
    n: int, columns: dict[str, Column], padded: bool, pad_values: PadValues, copy: bool
) -> TensorDict:
    """The TensorDict of fetched columns; ``copy``: private tensors instead of views of the
    received message or of the storage unit's shared memory (which they then stop pinning)."""
    if copy:
        columns = {name: col.clone() for name, col in columns.items()}
    return to_tensordict(n, columns, padded=padded, pad_values=pad_values)
