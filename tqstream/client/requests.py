"""What the client builds in the caller's thread, apart from its I/O: user data encoded into
columns and a put request, the requests of gets, partitions and checkpoints, and fetched columns
decoded into a TensorDict (``client.py`` sends and receives them on its IO thread or lanes)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from tqstream.client.core import GET_GRACE
from tqstream.client.deferred import Deferred, Signatures
from tqstream.client.versions import FRESH_MASK, fresh_mask, row_versions
from tqstream.convert.inputs import columns_from_data
from tqstream.convert.tensordict import to_tensordict
from tqstream.errors import BatchShapeError, InvalidRequestError, TagError
from tqstream.protocol.columns import Column, field_error
from tqstream.protocol.messages import (
    MAX_TAG_LIST,
    MAX_TAGS,
    CreatePartition,
    GetMeta,
    LoadCheckpoint,
    PrepareFields,
    PreparePut,
    SaveCheckpoint,
    UpsertRows,
)
from tqstream.staleness import StalenessPolicy, check_version
from tqstream.types import BatchMeta, RowShapes, Tags

if TYPE_CHECKING:
    from tensordict import TensorDict

PadValues = float | Mapping[str, float]


MAX_TAG_BYTES = 64 << 10
"""Encoded size of one row's tags: tags are bookkeeping the controller holds, not data."""
_SCALARS = (str, int, float, bool, type(None))


def check_tags(tags: Sequence[Mapping[str, Any] | None] | None, n: int) -> list[Tags | None] | None:
    """``tags`` as the wire carries them (one entry per row), or ``TagError`` saying what is
    wrong: each entry is None or a flat mapping of str to a scalar (str, int, float, bool, None;
    numpy scalars are converted) or a flat list of scalars."""
    if tags is None:
        return None
    if isinstance(tags, (Mapping, str)) or not isinstance(tags, Sequence):
        raise TagError(
            f"tags must be a list with one mapping (or None) per row, got {type(tags).__name__}"
        )
    if len(tags) != n:
        raise BatchShapeError(f"tags= has {len(tags)} entries but there are {n} rows", rows=n)
    out: list[Tags | None] = []
    for i, row in enumerate(tags):
        if row is None:
            out.append(None)
            continue
        if not isinstance(row, Mapping):
            raise TagError(
                f"tags of row {i} must be a mapping of str to scalars, got {type(row).__name__}",
                row=i,
            )
        if len(row) > MAX_TAGS:
            raise TagError(
                f"tags of row {i} have {len(row)} entries, at most {MAX_TAGS} are kept per row; "
                f"store larger per-row data as a field",
                row=i,
            )
        clean: Tags = {}
        for key, value in row.items():
            if not isinstance(key, str):
                raise TagError(f"tag names must be str, row {i} has {key!r}", row=i)
            clean[key] = _tag_value(i, key, value)
        if len(msgspec.msgpack.encode(clean)) > MAX_TAG_BYTES:
            raise TagError(
                f"tags of row {i} take more than {MAX_TAG_BYTES} bytes; tags are small "
                f"bookkeeping kept by the controller: store the data as a field",
                row=i,
            )
        out.append(clean)
    return out


def _tag_value(row: int, key: str, value: Any) -> Any:
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        value = value.item()
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= MAX_TAG_LIST:
        items = [v.item() if isinstance(v, np.generic) else v for v in value]
        if all(isinstance(v, _SCALARS) for v in items):
            return items
    what = type(value).__name__
    hint = " (.item() gives its number)" if isinstance(value, torch.Tensor) else ""
    raise TagError(
        f"tag {key!r} of row {row} is a {what}{hint}; a tag is a scalar (str, int, float, bool, "
        f"None) or a flat list of at most {MAX_TAG_LIST} scalars: store anything else as a field",
        row=row,
        tag=key,
    )


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
    tags: Sequence[Mapping[str, Any] | None] | None = None,
    signatures: Signatures | None = None,
    shapes: Mapping[str, RowShapes] | None = None,
) -> tuple[PreparePut, dict[str, Column] | Deferred]:
    """Encode the batch into columns and the prepare request (in the caller's thread). With
    ``signatures`` (a coalescing client's), an input whose signature is known is deferred
    (``deferred.py``): the request is made and checked, the columns are encoded when it is sent."""
    signed = None if signatures is None else signatures.of(data, versions_field)
    schemas = None
    if signatures is not None and signed is not None and not reject_mixed_versions:
        schemas = signatures.known(signed[0])
    encoded: dict[str, Column] | Deferred
    if schemas is not None and signed is not None:
        _, n, nbytes, fields = signed
        encoded = Deferred(fields, versions_field)
    else:
        n, columns = columns_from_data(data)
        schemas = {k: c.schema for k, c in columns.items()}
        nbytes, encoded = sum(c.nbytes for c in columns.values()), columns
    wire_tags = check_tags(tags, n)
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
    version = check_version(version, "version")
    dispatch: list[int | None] | None = None
    if isinstance(dispatch_version, (int, np.integer)):
        dispatch = [check_version(dispatch_version, "dispatch_version")] * n
    elif dispatch_version is not None:
        dispatch = [check_version(v, "dispatch_version") for v in dispatch_version]
        if len(dispatch) != n:
            raise BatchShapeError(
                f"dispatch_version= has {len(dispatch)} entries but the data has {n} rows",
                rows=n,
            )
    starts = ends = None
    if isinstance(encoded, dict) and versions_field is not None and versions_field in encoded:
        starts, ends = row_versions(versions_field, encoded[versions_field], version)
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
            assert isinstance(encoded, dict)  # a put that rejects rows is never deferred
            encoded = {k: c.take(index) for k, c in encoded.items()}
            nbytes = sum(c.nbytes for c in encoded.values())
            pick = lambda seq: None if seq is None else [seq[i] for i in keep]  # noqa: E731
            keys, groups, dispatch = pick(keys), pick(groups), pick(dispatch)
            starts, ends, wire_tags = pick(starts), pick(ends), pick(wire_tags)
            if shapes:
                shapes = {f: s.select(pick) for f, s in shapes.items()}
            n = len(keep)
    req = PreparePut(
        rid=0,
        partition=partition,
        n_rows=n,
        schemas=schemas,
        nbytes=nbytes,
        keys=keys,
        groups=groups,
        group_size=group_size,
        version=version,
        version_start=starts,
        version_end=ends,
        dispatch_version=dispatch,
        rejected=rejected,
        timeout=timeout,
        tags=wire_tags,
        shapes=None if shapes is None else dict(shapes),
    )
    if signatures is not None and signed is not None and isinstance(encoded, dict):
        signatures.learn(signed[0], schemas)
    return req, encoded


def check_keys(keys: Any) -> list[str]:
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise InvalidRequestError(f"keys must be a list of str, got {type(keys).__name__}")
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise InvalidRequestError(f"keys must be strings, got {type(bad[0]).__name__} {bad[0]!r}")
    if not keys:
        raise InvalidRequestError("keys= is empty: name at least one row")
    return list(keys)


def upsert_message(
    partition: str,
    keys: Sequence[str],
    tags: Sequence[Mapping[str, Any] | None] | None,
    create: bool,
) -> UpsertRows:
    names = check_keys(keys)
    return UpsertRows(
        rid=0, partition=partition, keys=names, tags=check_tags(tags, len(names)), create=create
    )


def tags_message(meta: BatchMeta, tags: Sequence[Mapping[str, Any] | None]) -> UpsertRows:
    return UpsertRows(
        rid=0,
        partition=meta.partition,
        keys=[],
        tags=check_tags(tags, len(meta)),
        create=False,
        row_ids=list(meta.row_ids),
    )


def fields_request(
    partition: str,
    columns: dict[str, Column],
    *,
    row_ids: Sequence[int] = (),
    keys: Sequence[str] | None = None,
    tags: Sequence[Mapping[str, Any] | None] | None = None,
    create: bool = False,
    overwrite: bool = False,
    version: int | None = None,
    versions_field: str | None = "versions",
    shapes: Mapping[str, RowShapes] | None = None,
) -> PrepareFields:
    """The request of a ``put_fields`` (rows by id) or ``put_by_keys`` (rows by key), in the
    caller's thread: the rows' policy versions come from a per-token versions field or
    ``version``, as for a put."""
    n = len(keys) if keys is not None else len(row_ids)
    starts = ends = None
    if versions_field is not None and versions_field in columns:
        starts, ends = row_versions(versions_field, columns[versions_field], version)
    elif version is not None:
        starts = ends = [version] * n
    return PrepareFields(
        rid=0,
        partition=partition,
        row_ids=list(row_ids),
        schemas={k: c.schema for k, c in columns.items()},
        nbytes=sum(c.nbytes for c in columns.values()),
        keys=keys if keys is None else list(keys),
        create=create,
        overwrite=overwrite,
        tags=check_tags(tags, n),
        version_start=starts,
        version_end=ends,
        shapes=None if shapes is None else dict(shapes),
    )


def keyed_columns(keys: Sequence[str], data: Any) -> tuple[list[str], dict[str, Column]]:
    """The keys and columns of ``put_by_keys`` with data: one row of data per key."""
    names = check_keys(keys)
    n, columns = columns_from_data(data)
    if n != len(names):
        raise BatchShapeError(
            f"put_by_keys got {n} rows of data for {len(names)} keys; pass one row per key, in "
            f"the keys' order",
            rows=n,
            expected=len(names),
        )
    return names, columns


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


def read_window(
    staleness: StalenessPolicy | None, max_staleness: int | None, measure: str, on_stale: str
) -> StalenessPolicy:
    """The window of a read: ``staleness``, or the policy that the keywords of ``Client.get`` make
    (where ``on_stale`` is "keep" by default). Both at once are refused, as one would be ignored."""
    if staleness is None:
        return StalenessPolicy(max_staleness, measure, on_stale)
    if not isinstance(staleness, StalenessPolicy):
        raise InvalidRequestError(
            f"staleness must be a tqstream.StalenessPolicy, got {type(staleness).__name__}"
        )
    if (max_staleness, measure, on_stale) != (None, "head", "keep"):
        raise InvalidRequestError(
            "pass the staleness window as staleness=StalenessPolicy(...) or as max_staleness=, "
            "measure= and on_stale=, not both"
        )
    return staleness


def get_request(
    partition: str,
    fields: Sequence[str] | str,
    batch_size: int,
    task: str,
    whole_groups: bool,
    lease_timeout: float | None,
    timeout: float | None,
    current_version: int | None,
    window: StalenessPolicy,
    versions_field: str = "versions",
) -> GetMeta:
    if isinstance(fields, str):
        fields = [fields]
    current_version = check_version(current_version, "current_version")
    if window.measure == "token":  # the per-token versions come along, to make the mask of
        if FRESH_MASK in fields:
            raise InvalidRequestError(
                f"a measure='token' read adds the field {FRESH_MASK!r}; the partition has a field "
                f"of that name too: rename it, or read with another measure"
            )
        fields = list(dict.fromkeys([*fields, versions_field]))
    return GetMeta(
        rid=0,
        partition=partition,
        fields=list(fields),
        batch_size=batch_size,
        task=task,
        whole_groups=whole_groups,
        lease_timeout=lease_timeout,
        timeout=timeout,
        current_version=current_version,
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


def with_fresh_mask(
    meta: BatchMeta, columns: dict[str, Column], versions_field: str
) -> tuple[BatchMeta, dict[str, Column]]:
    """A token-measure read's columns with :data:`FRESH_MASK`, and its meta with the count of
    generated tokens outside the window (``meta.token_window`` says it was one); others as they
    are."""
    if meta.token_window is None:
        return meta, columns
    version, staleness = meta.token_window or (None, None)
    columns, masked = fresh_mask(columns, versions_field, version, staleness, keep_versions=True)
    return msgspec.structs.replace(meta, tokens_masked=masked), columns


def decode(
    n: int, columns: dict[str, Column], padded: bool, pad_values: PadValues, copy: bool
) -> tuple[TensorDict | None, dict[str, Column]]:
    """The TensorDict of fetched columns, and the columns; ``copy``: private tensors instead of
    views of the received message or of the storage unit's shared memory (which they then stop
    pinning). The TensorDict is None when nothing in building it can fail (dense and jagged
    fields): ``Batch.data`` builds it on first use."""
    if copy:
        columns = {name: col.clone() for name, col in columns.items()}
    if padded or any(col.schema.kind == "object" for col in columns.values()):
        return to_tensordict(n, columns, padded=padded, pad_values=pad_values), columns
    for name, col in columns.items():
        if col.n_rows != n:
            raise field_error(BatchShapeError, name, f"has {col.n_rows} rows, expected {n}")
    return None, columns
