"""TransferQueue's data conventions, translated to and from tqstream's columns.

TransferQueue stores every field sample by sample and hands a batch back assembled from the
samples: a tensor field whose samples have one or more dimensions comes back as a jagged nested
tensor (even when every sample has the same shape), a field of one number per sample as a dense
``[B]`` tensor, anything else as a ``NonTensorStack``. tqstream keeps fields columnar, so the put
side stores a dense ``[B, L, ...]`` tensor as a *ragged* field (the same bytes, with offsets: no
copy), which lets a field's length differ from one put to the next as TransferQueue allows, and the
get side builds exactly the forms above from the columns, without copying tensor bytes.

``NonTensorData`` whose data is a sequence of one value per sample is read as those values (how
TransferQueue's storage treats it); any other ``NonTensorData`` is one value for every sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tqstream.errors import BatchShapeError, SchemaError
from tqstream.protocol.columns import jagged
from tqstream.types import FieldSchema, RowShapes

__all__ = ["batch_size_of", "field_meta", "from_tqstream", "row_shapes", "to_tqstream"]


def batch_size_of(data: Any) -> int:
    """The number of samples of a put's data (a TensorDict's first batch dimension)."""
    if isinstance(data, TensorDictBase):
        if not data.batch_size:
            raise BatchShapeError(
                "put data needs a batch dimension: TensorDict(..., batch_size=[n]) with one entry "
                "per sample"
            )
        return int(data.batch_size[0])
    if isinstance(data, Mapping):
        for value in data.values():
            return len(value)
        return 0
    raise SchemaError(f"put data must be a TensorDict, got {type(data).__name__}")


def to_tqstream(data: Any) -> dict[str, Any]:
    """A put's data (TensorDict or mapping of B samples per field) as tqstream's put input."""
    n = batch_size_of(data)
    items = (
        [(k, data.get(k)) for k in data.keys()]  # noqa: SIM118 (iterating a td yields rows)
        if isinstance(data, TensorDictBase)
        else list(data.items())
    )
    return {name: _field(name, value, n) for name, value in items}


def _field(name: str, value: Any, n: int) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        if value.is_nested or value.ndim < 2:
            return value  # jagged / strided nested: ragged; [B]: one number per sample
        return _as_jagged(value)
    if isinstance(value, NonTensorData):
        inner = value.data
        if isinstance(inner, (list, tuple, np.ndarray)) and len(inner) == n:
            return [_plain(v) for v in inner]
        return [_plain(inner)] * n
    if isinstance(value, NonTensorStack):
        return [_plain(v) for v in _stacked(value)]
    if isinstance(value, np.ndarray):  # str / bytes / object arrays: one value per sample
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, TensorDictBase):
        raise SchemaError(
            f"field {name!r} is a nested TensorDict; flatten it first (td.flatten_keys('.'))",
            field=name,
        )
    return value


def _stacked(stack: NonTensorStack) -> list[Any]:
    """``stack.tolist()``, read from each element's own storage: ``tolist`` and ``.data`` go
    through tensorclass attribute machinery that costs milliseconds for a batch of 256."""
    out = []
    for item in stack.tensordicts:
        own = getattr(item, "_non_tensordict", None)
        if isinstance(item, NonTensorData) and isinstance(own, dict) and "data" in own:
            out.append(own["data"])
        elif isinstance(item, NonTensorStack):
            out.append(_stacked(item))
        else:
            out.append(item.data)
    return out


def _plain(v: Any) -> Any:
    """numpy scalars as Python values (they are what ``.tolist()`` of an array gives)."""
    return v.item() if isinstance(v, np.generic) else v


def _as_jagged(t: torch.Tensor) -> torch.Tensor:
    """``[B, L, ...]`` as a jagged nested tensor of B samples ``[L, ...]``: a view, no copy for a
    contiguous tensor."""
    b, length = t.shape[0], t.shape[1]
    values = t.reshape(b * length, *t.shape[2:])
    return jagged(values, torch.arange(b + 1, dtype=torch.int64) * length)


def from_tqstream(td: TensorDict) -> TensorDict:
    """tqstream's TensorDict of a get in TransferQueue's forms (see the module docstring)."""
    out: dict[str, Any] = {}
    for name in td.keys():  # noqa: SIM118
        value = td.get(name)
        if isinstance(value, torch.Tensor) and not value.is_nested and value.ndim >= 2:
            value = _as_jagged(value)
        out[name] = value
    return TensorDict(out, batch_size=td.batch_size)


def field_meta(schema: FieldSchema | None, shapes: RowShapes | None = None) -> dict[str, Any]:
    """A field's schema as TransferQueue's metadata describes it (``dtype``, ``shape``,
    ``is_nested``, ``is_non_tensor`` and, nested, ``per_sample_shapes``). ``shapes``: the
    controller's record of a field put through this layer (see :func:`row_shapes`); a ragged field
    without one (put by a tqstream client) is nested, its per-sample shapes unlisted."""
    if schema is None:  # declared, never written
        return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False}
    if schema.kind == "object":
        return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    dtype = getattr(torch, schema.dtype)
    if schema.kind == "ragged" and shapes is not None:
        if shapes.nested:
            return {"dtype": dtype, "shape": None, "is_nested": True, "is_non_tensor": False,
                    "per_sample_shapes": list(shapes.rows or ())}  # fmt: skip
        shape = torch.Size(shapes.shape or ())
        return {"dtype": dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}
    if schema.kind == "ragged":
        return {"dtype": dtype, "shape": None, "is_nested": True, "is_non_tensor": False}
    shape = torch.Size(schema.shape or (1,))  # one number per sample reads as [1]
    return {"dtype": dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}


def row_shapes(data: Any) -> dict[str, RowShapes]:
    """What TransferQueue's controller records of a put's tensor fields of one or more dimensions
    per sample (tqstream stores them ragged, see the module docstring): a regular ``[B, ...]``
    tensor gives its samples' one shape, a nested tensor each sample's."""
    items = data.items() if isinstance(data, (TensorDictBase, Mapping)) else ()
    out: dict[str, RowShapes] = {}
    for name, value in items:
        if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_nested:
            out[name] = RowShapes(True, None, [tuple(row.shape) for row in value.unbind()])
        elif value.ndim >= 2:
            out[name] = RowShapes(False, tuple(value.shape[1:]))
    return out
