"""tqstream rows → verl ``DataProto``: decode the layout, re-pad a rollout, restore the arrays.

The inverse of :func:`~tqstream.adapters.verl.dataproto.dataproto_to_rows`. Rows are read jagged
(or padded with ``<field>_lengths``). For a rollout, ``prompts`` are left-padded and the
response-aligned fields right-padded to the widths asked for (default: the widest put's), with
one boolean placement each for the whole batch, and ``attention_mask``, ``input_ids`` and
``position_ids`` are rebuilt from the lengths (the positions verl's
``compute_position_id_with_mask`` gives). Other batch tensors come back as they were read;
``non_tensor_batch`` arrays get their numpy dtypes and shapes back from the row layout (object
values decoded by :mod:`.objects`; an array that folded a put's rows its folded shape, for that
put's rows), and ``meta_info`` is the put's (or the puts' merged).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

import tqstream.adapters.verl.padding as padding
from tqstream.adapters.verl.dataproto import stored_dense
from tqstream.adapters.verl.layout import (
    LAYOUT_FIELD,
    Merged,
    Rollout,
    decode_layouts,
    merge_layouts,
    merge_meta_info,
)
from tqstream.adapters.verl.objects import decode_rows
from tqstream.client.client import Batch
from tqstream.convert.tensordict import decode_objects
from tqstream.errors import InvalidRequestError, MalformedMessageError, SchemaError
from tqstream.protocol.columns import jagged, torch_dtype

__all__ = ["Missing", "convert", "rows_to_dataproto"]


def rows_to_dataproto(
    batch: Batch | Any,
    *,
    keys: Sequence[str] | None = None,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """A ``DataProto`` of read rows (a ``Batch`` or its TensorDict; ragged fields jagged, or padded
    with ``<field>_lengths``); a rollout is re-padded to ``prompt_length`` / ``response_length``.

    ``keys``: the ``DataProto`` keys asked for (what :func:`stored_fields` read): of the
    object-valued ``non_tensor_batch`` keys, which the layout field brings all of, only these are
    kept, and one the rows do not have (not read, not rebuilt, no object value) raises
    ``SchemaError``. None keeps every one. Widths and pad id default to the widest put's and the
    put's own, which gives back an equal ``DataProto`` for a put's rows. Rows without the
    ``dataproto`` layout field (put by other producers) are converted as a rollout: ragged fields
    are response-aligned, object fields become object arrays, and the widths are the longest
    row's.
    """
    out = convert(batch, keys, prompt_length, response_length, pad_token_id)
    if isinstance(out, Missing):
        raise SchemaError(
            f"the rows read have no {out.keys} (not a field read, not rebuilt, no object value in "
            f"their layout): name them in stored_fields(keys, written) once they are written, or "
            f"check the spelling",
            keys=out.keys,
        )
    return out


class Missing(NamedTuple):
    """Keys asked for that the rows read do not have (:func:`convert`)."""

    keys: list[str]


def convert(
    batch: Batch | Any,
    asked: Sequence[str] | None,
    prompt_length: int | None,
    response_length: int | None,
    pad_token_id: int | None,
) -> Any:
    """:func:`rows_to_dataproto`, or :class:`Missing` for keys asked for that the rows do not
    have (a reader that took an unwritten field for an object-valued key reads again)."""
    td: Any = batch
    if isinstance(batch, Batch):
        td = batch.data if batch.columns is None else _Columns(batch)
    keys = list(td.keys())
    if LAYOUT_FIELD not in keys:
        return _foreign(td, keys, prompt_length, response_length, pad_token_id)
    heads, objects = _layout_rows(td, keys)
    merged = merge_layouts(decode_layouts(heads))
    n = len(merged.rows)
    if n != int(td.batch_size[0]) and len(keys) > 1 + (f"{LAYOUT_FIELD}_lengths" in keys):
        raise SchemaError(  # such rows hold only the layout, so no other field can be read
            "the batch mixes rows of DataProtos without rows with fields of other rows"
        )
    if not n:
        return _no_rows(merged)
    ro = merged.rollout
    # object-valued non_tensor_batch keys: their values came with the layout
    carried = [
        k for k, (dtype, _) in (merged.non_tensor or {}).items()
        if not stored_dense(dtype) and (asked is None or k in asked)
    ]  # fmt: skip
    if asked is not None:
        have = {*keys, *carried}
        if ro is not None and "prompts" in keys and "responses" in keys:
            have.update(ro.derived)
        missing = [k for k in dict.fromkeys(asked) if k not in have]
        if missing:
            return Missing(missing)
    tensors: dict[str, Any] = {}
    ragged = {LAYOUT_FIELD, *merged.nested}
    widths: tuple[int, int | None] = (0, None)
    r_rows: tuple[torch.Tensor, np.ndarray] | None = None  # responses' offsets and keep
    if ro is not None:
        ragged.update(("prompts", "responses", *ro.response))
        widths, r_rows = _rollout(
            td, keys, ro, tensors, prompt_length, response_length, pad_token_id
        )
    dense: dict[str, np.ndarray] = {}
    for key in keys:
        if (
            key in tensors
            or key == LAYOUT_FIELD
            or (key.endswith("_lengths") and key[:-8] in ragged)
        ):
            continue
        if merged.non_tensor is not None and key in merged.non_tensor:
            dtype, _ = merged.non_tensor[key]
            if stored_dense(dtype):  # else the empty marker field earlier versions wrote
                dense[key] = td.get(key).numpy().astype(dtype, copy=True)
        elif ro is not None and key in ro.response:
            values, offsets = _ragged(td, keys, key)
            width = widths[1]
            if width is None:  # responses not read: the field's own width
                width = _width("response_length", response_length, ro.response_length, offsets)
            # the rows of a response-aligned field are the responses' (one put wrote both),
            # unless the field was stored whole (its padding was not 0)
            keep = r_rows[1] if r_rows is not None and torch.equal(offsets, r_rows[0]) else None
            if keep is None:
                _fits(key, offsets, width)
            tensors[key] = padding.pad_rows(values, offsets, width, 0, left=False, keep=keep)
        elif key in merged.nested:
            value = td.get(key)
            tensors[key] = value if value.is_nested else jagged(*_ragged(td, keys, key))
        else:
            tensors[key] = td.get(key)
    non_tensor: dict[str, np.ndarray] | None = None
    if merged.non_tensor is not None:  # in the put's order
        non_tensor = {}
        for key, (dtype, trailing) in merged.non_tensor.items():
            if key in dense:
                non_tensor[key] = dense[key]
            elif key in carried:
                found = _object_values(key, objects, merged.rows)
                non_tensor[key] = _array(key, found, dtype, trailing)
    return _dataproto(merged, n, tensors, non_tensor, merge_meta_info(merged.meta_infos))


def _dataproto(
    merged: Merged,
    n: int,
    tensors: dict[str, Any],
    non_tensor_: dict[str, np.ndarray] | None,
    meta_info: Any,
) -> Any:
    from tensordict import TensorDict
    from verl.protocol import DataProto

    non_tensor: Any = non_tensor_  # verl annotates a dict, and holds None when given None
    td = None if merged.batch is None else TensorDict(tensors, batch_size=[n, *merged.batch])
    if td is None or not merged.batch:
        out = DataProto(batch=td, non_tensor_batch=non_tensor, meta_info=meta_info)
    else:
        # several batch dims: what verl's unfold_batch_dim leaves in the DataProto it is given,
        # which DataProto's own check refuses at construction
        out = DataProto(batch=None, non_tensor_batch=non_tensor, meta_info=meta_info)
        out.batch = td
    if out.non_tensor_batch is not None:  # folded after the check, which refuses them too
        _fold(out.non_tensor_batch, merged.folded, n)
    return out


def _fold(non_tensor: dict[str, np.ndarray], folded: dict[str, list[int]], n: int) -> None:
    """Give the arrays whose leading dims folded a put's rows (verl's ``fold_batch_dim``) their
    shape back, when the ``n`` rows read hold that put's first row and as many rows as it had
    (:mod:`.layout`); any other selection keeps them row by row, ``[n, ...]``."""
    for key, dims in folded.items():
        arr = non_tensor.get(key)
        if arr is not None and math.prod(dims) == n:
            non_tensor[key] = arr.reshape(*dims, *arr.shape[1:])


def _no_rows(merged: Merged) -> Any:
    """The ``DataProto`` of rows of ``DataProto``s without rows: empty tensors and arrays of the
    recorded dtypes and shapes, and their ``meta_info``."""
    dims = merged.batch or []
    tensors: dict[str, Any] = {}
    for key, (dtype, shape) in merged.empty.items():
        if key in merged.nested:
            tensors[key] = jagged(
                torch.empty((0, *shape), dtype=dtype), torch.zeros(1, dtype=torch.int64)
            )
        else:
            tensors[key] = torch.empty((0, *dims, *shape), dtype=dtype)
    non_tensor = None
    if merged.non_tensor is not None:
        non_tensor = {
            k: np.empty((0, *shape), dtype=dt) for k, (dt, shape) in merged.non_tensor.items()
        }
    return _dataproto(merged, 0, tensors, non_tensor, merge_meta_info(merged.meta_infos))


def _layout_rows(td: Any, keys: list[str]) -> tuple[list[Any], list[Any]]:
    """Each row's head (its layout's bytes) and map of object values (:mod:`.layout`)."""
    try:
        pairs = decode_rows(LAYOUT_FIELD, *_ragged(td, keys, LAYOUT_FIELD), per_row=2)
    except MalformedMessageError as exc:
        raise SchemaError(
            f"field {LAYOUT_FIELD!r} does not hold verl row layouts ({exc.message}); rows read "
            f"with rows_to_dataproto must have been put from a DataProto (dataproto_to_rows)"
        ) from exc
    return [h for h, _ in pairs], [o for _, o in pairs]


def _object_values(key: str, objects: list[Any], rows: list[int]) -> list[Any]:
    """The object values of ``key`` of the rows holding data, from their maps."""
    try:
        return [objects[i][key] for i in rows]
    except (KeyError, TypeError) as exc:
        raise SchemaError(
            f"non_tensor_batch[{key!r}]: a row read has no value for it ({exc!r}); the rows read "
            f"come from DataProtos with different non_tensor_batch keys: read them separately",
            field=key,
        ) from exc


def _array(
    key: str, values: list[Any], dtype: np.dtype[Any], trailing: tuple[int, ...]
) -> np.ndarray:
    """A ``non_tensor_batch`` array of its put's dtype and shape, from its decoded values."""
    n = len(values)
    try:
        if dtype.kind in "US":
            return np.array(values, dtype=dtype).reshape(n, *trailing)
        if dtype.kind == "O" and not trailing:
            return np.fromiter(values, dtype=object, count=n)
        out = np.empty((n, *trailing), dtype=dtype)
        for i, value in enumerate(values):
            out[i] = value
        return out
    except (ValueError, TypeError) as exc:
        raise SchemaError(
            f"field {key!r}: its rows are not {dtype} values of shape {list(trailing)} ({exc}); "
            f"were they put with dataproto_to_rows?",
            field=key,
        ) from exc


class _Columns:
    """A ``Batch``'s columns, read as its TensorDict would be (``keys``, ``get``,
    ``batch_size``), but a ragged field's packed values and offsets taken as they are
    (:func:`_ragged`), without making the jagged nested tensor."""

    def __init__(self, batch: Batch) -> None:
        assert batch.columns is not None
        self.columns = batch.columns
        self.batch_size = (len(batch.meta),)

    def keys(self) -> list[str]:
        return list(self.columns)

    def get(self, name: str) -> Any:
        col = self.columns[name]
        if col.offsets is None:
            return col.values
        if col.schema.kind == "object":
            return decode_objects(name, col)
        return jagged(col.values, col.offsets)


def _ragged(td: Any, keys: list[str], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` of a ragged field read jagged, or padded with its lengths."""
    if isinstance(td, _Columns):
        col = td.columns[name]
        if col.offsets is not None and col.schema.kind == "ragged":
            return col.values, col.offsets
    t = td.get(name)
    if t.is_nested:
        if getattr(t, "_lengths", 0) is None and getattr(t, "_ragged_idx", 0) == 1:
            return t._values, t._offsets  # torch's accessors dispatch: ~100 µs a field
        return t.values(), t.offsets()
    lengths_key = f"{name}_lengths"
    if lengths_key not in keys:
        raise SchemaError(
            f"field {name!r} was read dense ({list(t.shape)}) without {lengths_key!r}: read it "
            f"with padded=False (jagged) or padded=True (padded + lengths)"
        )
    lengths = td.get(lengths_key).to(torch.int64)
    keep = torch.arange(t.shape[1])[None, :] < lengths[:, None]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return t[keep], offsets


# --- rollouts ------------------------------------------------------------------------------------
def _rollout(
    td: Any,
    keys: list[str],
    ro: Rollout,
    tensors: dict[str, Any],
    prompt_length: int | None,
    response_length: int | None,
    pad_token_id: int | None,
) -> tuple[tuple[int, int | None], tuple[torch.Tensor, np.ndarray] | None]:
    """Re-pad ``prompts`` and ``responses`` and rebuild the derived tensors into ``tensors``
    (when both were read); the widths used (None: not read) and the responses' offsets and kept
    positions (for the response-aligned fields)."""
    if "prompts" not in keys or "responses" not in keys:
        return (0, None), None
    prompts = _ragged(td, keys, "prompts")
    responses = _ragged(td, keys, "responses")
    p_width = _width("prompt_length", prompt_length, ro.prompt_length, prompts[1])
    r_width = _width("response_length", response_length, ro.response_length, responses[1])
    pad = pad_token_id if pad_token_id is not None else ro.pad_token_id or 0
    p_offsets, r_offsets = prompts[1].to(torch.int64), responses[1].to(torch.int64)
    p_len, r_len = p_offsets[1:] - p_offsets[:-1], r_offsets[1:] - r_offsets[:-1]
    p_keep = padding.keeps(p_len, p_width, left=True)
    r_keep = padding.keeps(r_len, r_width, left=False)
    tensors["prompts"] = padding.pad_rows(*prompts, p_width, pad, left=True, keep=p_keep)
    tensors["responses"] = padding.pad_rows(*responses, r_width, pad, left=False, keep=r_keep)
    dtypes = {k: torch_dtype(v) for k, v in ro.derived.items()}
    tensors.update(_derived(dtypes, (p_len, r_len), (p_keep, r_keep), tensors))
    return (p_width, r_width), (r_offsets, r_keep)


def _fits(key: str, offsets: torch.Tensor, width: int) -> None:
    """Refuse to re-pad rows of a response-aligned field longer than ``width``: one stored
    whole (its padding was not 0) has its put's full width."""
    longest = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    if longest > width:
        raise InvalidRequestError(
            f"{key} has rows of {longest} positions (stored whole: its padding was not 0) but the "
            f"read re-pads to response_length={width}; pass at least {longest}"
        )


def _width(name: str, asked: int | None, stored: int, offsets: torch.Tensor) -> int:
    longest = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    if asked is None:
        return max(stored, longest)
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 0:
        raise InvalidRequestError(f"{name} must be an int >= 0, got {asked!r}")
    if asked < longest:
        raise InvalidRequestError(
            f"{name}={asked} is shorter than the longest row ({longest} tokens); pass at least "
            f"{longest} (verl's rollout.{name})"
        )
    return asked


def _derived(
    dtypes: dict[str, torch.dtype],
    lengths: tuple[torch.Tensor, torch.Tensor],
    keep: tuple[np.ndarray, np.ndarray],
    tensors: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """``attention_mask``, and ``input_ids`` / ``position_ids`` where they were derived, of the
    re-padded ``prompts`` and ``responses`` (``lengths``, their real positions ``keep``): the mask
    1 on the real tokens, the ids ``prompts ⧺ responses``, the positions verl's
    ``compute_position_id_with_mask`` gives."""
    prompts, responses = tensors["prompts"], tensors["responses"]
    p_width, r_width = prompts.shape[1], responses.shape[1]
    (p_len, r_len), mask = lengths, np.concatenate(keep, axis=1)
    out = {"attention_mask": _as(mask, dtypes.get("attention_mask", torch.int64))}
    if "input_ids" in dtypes:
        ids = [padding.numpy_view(t) for t in (prompts, responses)]
        out["input_ids"] = _as(np.concatenate(ids, axis=1), dtypes["input_ids"], prompts.dtype)
    if "position_ids" in dtypes:
        at = padding.positions(p_len, r_len, p_width, r_width)
        out["position_ids"] = _as(at, dtypes["position_ids"])
    return out


def _as(array: np.ndarray, dtype: torch.dtype, of: torch.dtype | None = None) -> torch.Tensor:
    """A fresh numpy array (of :func:`padding.numpy_view`s of ``of`` tensors) as a ``dtype``
    tensor."""
    t = torch.from_numpy(array)
    if of is not None and padding.bits_of(of) is not None:
        t = t.view(of)
    if t.dtype == dtype:
        return t
    if padding.bits_of(dtype) is None and padding.bits_of(t.dtype) is None:
        return torch.from_numpy(array.astype(torch.empty(0, dtype=dtype).numpy().dtype))
    return t.to(dtype)


# --- rows of other producers ---------------------------------------------------------------------
_FOREIGN = Rollout(0, 0, None, {"attention_mask": "int64", "input_ids": "int64",
                                "position_ids": "int64"}, [])  # fmt: skip


def _foreign(
    td: Any,
    keys: list[str],
    prompt_length: int | None,
    response_length: int | None,
    pad_token_id: int | None,
) -> Any:
    """Rows put without a layout: a rollout whose ragged fields are response-aligned."""
    from tensordict import TensorDict
    from verl.protocol import DataProto

    n = int(td.batch_size[0])
    for name in ("prompts", "responses"):
        if name not in keys:
            raise SchemaError(
                f"rows_to_dataproto needs the {name!r} field to rebuild the batch (read it; the "
                f"batch has {sorted(keys)})"
            )
    tensors: dict[str, Any] = {}
    widths, _ = _rollout(td, keys, _FOREIGN, tensors, prompt_length, response_length, pad_token_id)
    ragged = {k for k in keys if isinstance(td.get(k), torch.Tensor) and td.get(k).is_nested}
    ragged.update(k[:-8] for k in keys if k.endswith("_lengths") and k[:-8] in keys)
    non_tensor: dict[str, np.ndarray] = {}
    for key in keys:
        if key in tensors or (key.endswith("_lengths") and key[:-8] in ragged):
            continue
        value = td.get(key)
        if not isinstance(value, torch.Tensor):
            non_tensor[key] = _object_array(key, value, n)
        elif key in ragged:
            width = widths[1]
            assert width is not None
            tensors[key] = padding.pad_rows(*_ragged(td, keys, key), width, 0, left=False)
        else:
            tensors[key] = value
    return DataProto(
        batch=TensorDict(tensors, batch_size=[n]), non_tensor_batch=non_tensor, meta_info={}
    )


def _object_array(key: str, value: Any, n: int) -> np.ndarray:
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    if len(values) != n:
        raise SchemaError(f"field {key!r} has {len(values)} values for {n} rows")
    return np.fromiter(values, dtype=object, count=n)  # lists stay elements, never a 2-D array
