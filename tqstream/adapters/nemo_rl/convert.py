"""Checks and conversions between NeMo-RL's arguments and tqstream's: keys, tags, the ``fields``
TensorDict of a put, and the TensorDict a read returns.

Everything here runs in the caller's process before a request is sent, so a refused argument
stores nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tqstream.adapters.nemo_rl.config import TQStreamDataPlaneConfig
from tqstream.adapters.nemo_rl.errors import FieldTypeError
from tqstream.convert.inputs import columns_from_data
from tqstream.errors import InvalidRequestError, SchemaError

__all__ = ["check_names", "densify", "put_fields", "put_tags", "row_metadata"]

_NON_TENSOR = (NonTensorData, NonTensorStack)  # TensorDicts themselves, of Python values


def check_names(values: Any, what: str, *, empty_ok: bool = True) -> list[str]:
    """``values`` as a list of str (``sample_ids``, ``select_fields``, ``consumer_tasks``, ...)."""
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise FieldTypeError(f"{what} must be a list of str, got {type(values).__name__}")
    bad = [v for v in values if not isinstance(v, str) or not v]
    if bad:
        raise FieldTypeError(
            f"{what} must hold non-empty str, got {type(bad[0]).__name__} {bad[0]!r}"
        )
    if not values and not empty_ok:
        raise InvalidRequestError(f"{what} is empty: name at least one")
    return list(values)


def put_tags(tags: Any, n: int) -> list[dict[str, Any]] | None:
    """One shallow-copied dict per row, 0-dim tensors and numpy scalars turned into their Python
    numbers (``KVBatchMeta.stamp_tags`` stores the elements of a tensor, which tags cannot hold as
    such). The controller checks the rest (flat scalars, sizes)."""
    if tags is None:
        return None
    if isinstance(tags, (Mapping, str)) or not isinstance(tags, Sequence):
        raise FieldTypeError(
            f"tags must be a list with one dict per row, got {type(tags).__name__}"
        )
    if len(tags) != n:
        raise InvalidRequestError(
            f"tags has {len(tags)} entries for {n} sample_ids; pass one per row"
        )
    out: list[dict[str, Any]] = []
    for i, row in enumerate(tags):
        if row is None:
            out.append({})
            continue
        if not isinstance(row, Mapping):
            raise FieldTypeError(f"tags[{i}] must be a dict, got {type(row).__name__}")
        out.append({k: _scalar(v) for k, v in row.items()})
    return out


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_nested:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def put_fields(fields: Any, config: TQStreamDataPlaneConfig) -> TensorDictBase | Mapping[str, Any]:
    """The ``fields`` of a put, checked: a TensorDict (or a mapping of field name to values) whose
    leaves are tensors (dense of any rank, or jagged nested) or non-tensor values tqstream stores
    without pickling (str, bytes, JSON). Raises FieldTypeError (a TypeError) otherwise."""
    if not isinstance(fields, (TensorDictBase, Mapping)):
        raise FieldTypeError(
            f"fields must be a TensorDict (or a dict of field name to tensor), got "
            f"{type(fields).__name__}"
        )
    names = list(fields.keys())
    for name in names:
        value = fields.get(name) if isinstance(fields, TensorDictBase) else fields[name]
        if isinstance(value, torch.Tensor) or (
            isinstance(value, TensorDictBase) and not isinstance(value, _NON_TENSOR)
        ):
            continue  # tensors; nested TensorDicts are refused by the put, with its message
        if config.non_tensor_fields == "reject":
            raise FieldTypeError(
                f"field {name!r} is a non-tensor leaf ({type(value).__name__}) and this data "
                f"plane is configured with tqstream.non_tensor_fields='reject'; store it as a "
                f"tensor, or set non_tensor_fields: store",
                field=name,
            )
        try:  # the put's own rules, so the check never disagrees with the put
            columns_from_data({name: value})
        except SchemaError as exc:
            raise FieldTypeError(
                f"field {name!r} is a non-tensor leaf tqstream cannot store without pickling "
                f"({exc}); non-tensor fields hold str, bytes or JSON values per row",
                field=name,
            ) from exc
    return fields


def row_metadata(
    keys: list[str], tags: list[dict[str, Any]] | None, config: TQStreamDataPlaneConfig
) -> tuple[int | None, list[str | None] | None]:
    """The policy version and groups new rows get from NeMo-RL's conventions: every row tagged
    with the same int ``config.version_tag``, and keys ``{group}_g{i}`` (``group_key_pattern``).
    ``(None, None)`` when the rows do not follow them."""
    version = None
    if tags:
        values = {row.get(config.version_tag) for row in tags}
        if len(values) == 1:
            (v,) = values
            if isinstance(v, int) and not isinstance(v, bool):
                version = v
    groups: list[str | None] | None = None
    if config.group_key_pattern:
        pattern = re.compile(config.group_key_pattern)
        found = [pattern.fullmatch(k) for k in keys]
        if all(found):
            groups = [m.group("group") for m in found if m is not None]
    return version, groups


def densify(td: TensorDict) -> TensorDict:
    """Jagged fields whose rows all have the same length as dense tensors, as NeMo-RL's adapters
    return them (a zero-copy view of the values); ragged fields stay jagged."""
    out = {}
    for name in list(td.keys()):
        value = td.get(name)
        dense = _uniform(value) if getattr(value, "is_nested", False) else None
        out[name] = value if dense is None else dense
    return TensorDict(out, batch_size=td.batch_size)


def _uniform(nested: Any) -> torch.Tensor | None:  # Any: NestedTensor methods are untyped
    offsets = nested.offsets()
    lengths = offsets.diff()
    if not lengths.numel() or not bool((lengths == lengths[0]).all()):
        return None
    values = nested.values()[int(offsets[0]) : int(offsets[-1])]
    return values.view(len(lengths), int(lengths[0]), *values.shape[1:])
