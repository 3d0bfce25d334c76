"""tqstream rows → verl ``DataProto``: re-pad, rebuild the derived tensors, restore the arrays.

The inverse of :func:`~tqstream.adapters.verl.dataproto.dataproto_to_rows`. Rows are read jagged
(or padded with ``<field>_lengths``); ``prompts`` are left-padded and the response-aligned fields
right-padded to the widths asked for (default: the widest put's), with a few scatters for the whole
batch; ``attention_mask``, ``input_ids`` and ``position_ids`` are rebuilt from the lengths with
verl's own ``compute_position_id_with_mask``; ``non_tensor_batch`` arrays get their numpy dtypes
back from the row layout, and ``meta_info`` is the put's (or the puts' merged).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import tqstream.adapters.verl.padding as padding
from tqstream.adapters.verl.layout import (
    DERIVED_FIELDS,
    LAYOUT_FIELD,
    Merged,
    merge_layouts,
    merge_meta_info,
)
from tqstream.client.client import Batch
from tqstream.errors import InvalidRequestError, SchemaError
from tqstream.protocol.codec import torch_dtype

__all__ = ["rows_to_dataproto"]


def rows_to_dataproto(
    batch: Batch | Any,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """A ``DataProto`` of read rows (a ``Batch`` or its TensorDict; ragged fields jagged, or padded
    with ``<field>_lengths``), re-padded to ``prompt_length`` / ``response_length``.

    Widths and pad id default to the widest put's and the put's own, which gives back an equal
    ``DataProto`` for a put's rows. Rows without the ``dataproto`` layout field (put by other
    producers) are converted too: ragged fields are response-aligned, object fields become
    object arrays, and the widths are the longest row's.
    """
    from verl.protocol import DataProto

    td = batch.data if isinstance(batch, Batch) else batch
    n = int(td.batch_size[0])
    keys = list(td.keys())
    for name in ("prompts", "responses"):
        if name not in keys:
            raise SchemaError(
                f"rows_to_dataproto needs the {name!r} field to rebuild the batch (read it; the "
                f"batch has {sorted(keys)})"
            )
    merged = _layout(td, keys)
    prompts = _ragged(td, keys, "prompts")
    responses = _ragged(td, keys, "responses")
    p_width = _width("prompt_length", prompt_length, merged.prompt_length, prompts[1])
    r_width = _width("response_length", response_length, merged.response_length, responses[1])
    pad = pad_token_id if pad_token_id is not None else merged.pad_token_id or 0
    tensors: dict[str, torch.Tensor] = {
        "prompts": padding.pad_rows(*prompts, p_width, pad, left=True),
        "responses": padding.pad_rows(*responses, r_width, pad, left=False),
    }
    tensors.update(_derived(merged, prompts[1], responses[1], tensors, p_width, r_width))
    non_tensor: dict[str, np.ndarray] = {}
    ragged = _ragged_names(td, keys, merged, LAYOUT_FIELD in keys)
    skip = {"prompts", "responses", LAYOUT_FIELD, *(f"{k}_lengths" for k in ragged)}
    for key in keys:
        if key in skip:
            continue
        value = td.get(key)
        if not isinstance(value, torch.Tensor):
            non_tensor[key] = _object_array(key, value, n, merged.non_tensor.get(key))
        elif key in merged.non_tensor:
            non_tensor[key] = value.numpy().astype(merged.non_tensor[key], copy=True)
        elif key in ragged:
            tensors[key] = padding.pad_rows(*_ragged(td, keys, key), r_width, 0, left=False)
        else:
            tensors[key] = value
    from tensordict import TensorDict

    return DataProto(
        batch=TensorDict(tensors, batch_size=[n]),
        non_tensor_batch=non_tensor,
        meta_info=merge_meta_info(merged.meta_infos),
    )


def _layout(td: Any, keys: list[str]) -> Merged:
    if LAYOUT_FIELD not in keys:
        return Merged(0, 0, None, dict.fromkeys(DERIVED_FIELDS, "int64"), [], {}, [])
    return merge_layouts(td.get(LAYOUT_FIELD).tolist())


def _ragged_names(td: Any, keys: list[str], merged: Merged, has_layout: bool) -> set[str]:
    """The response-aligned fields to re-pad: the layout's, and any read jagged (or, for rows of
    other producers, read padded with ``<field>_lengths``)."""
    out = {"prompts", "responses", *(k for k in merged.response if k in keys)}
    for key in keys:
        value = td.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            out.add(key)
        elif not has_layout and key.endswith("_lengths") and key[: -len("_lengths")] in keys:
            out.add(key[: -len("_lengths")])
    return out


def _ragged(td: Any, keys: list[str], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` of a ragged field read jagged, or padded with its lengths."""
    t = td.get(name)
    if t.is_nested:
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
    merged: Merged,
    p_offsets: torch.Tensor,
    r_offsets: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    p_width: int,
    r_width: int,
) -> dict[str, torch.Tensor]:
    from verl.utils.model import compute_position_id_with_mask

    p_len = (p_offsets[1:] - p_offsets[:-1]).to(torch.int64)
    r_len = (r_offsets[1:] - r_offsets[:-1]).to(torch.int64)
    dtypes = {k: torch_dtype(v) for k, v in merged.derived.items()}
    mask = padding.attention_mask(p_len, r_len, p_width, r_width, torch.int64)
    out = {"attention_mask": mask.to(dtypes.get("attention_mask", torch.int64))}
    if "input_ids" in dtypes:
        ids = torch.cat([tensors["prompts"], tensors["responses"]], dim=1)
        out["input_ids"] = ids.to(dtypes["input_ids"])
    if "position_ids" in dtypes:
        out["position_ids"] = compute_position_id_with_mask(mask).to(dtypes["position_ids"])
    return out


def _object_array(key: str, value: Any, n: int, dtype: np.dtype[Any] | None) -> np.ndarray:
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    if len(values) != n:
        raise SchemaError(f"field {key!r} has {len(values)} values for {n} rows")
    if dtype is not None and dtype.kind in "US":
        return np.array(values, dtype=dtype)
    arr = np.empty(n, dtype=object)
    for i, v in enumerate(values):  # element by element: lists must not become a 2-D array
        arr[i] = v
    return arr
