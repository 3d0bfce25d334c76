"""verl ``DataProto`` → tqstream rows (:mod:`.rebuild` goes back).

``dataproto_to_rows`` turns any ``DataProto`` into one put's worth of rows, one per sample, that
:func:`~tqstream.adapters.verl.rebuild.rows_to_dataproto` turns back into an equal one (verl's own
equality: values, dtypes, shapes, Python types):

- a *rollout* (``prompts`` ``[B, P]``, ``responses`` ``[B, R]`` and an ``attention_mask``
  ``[B, P + R]``, as verl's agent loop pads them) is stored unpadded: ``prompts`` without their left
  padding, ``responses`` and the response-aligned fields (``response_mask``, ``rollout_log_probs``,
  any ``response_fields=``) without their right padding (ragged fields, so no byte of padding is
  stored and rows of batches padded to different widths mix), after checking that the masks agree
  with the padding. ``attention_mask``, and ``input_ids`` / ``position_ids`` when they are what
  verl computes from it, are not stored but rebuilt;
- every other batch tensor is a field as it is (dense, or ragged for a jagged nested tensor);
- each numeric ``non_tensor_batch`` array is a dense field; every other one (object, string,
  datetime arrays, of any number of dims) is no field of its own: its values are exactly encoded
  (:mod:`.objects`: msgpack with extension types, never pickle) in the row's ``dataproto`` field,
  one map per row of all such values, so reading that field brings them all;
- ``uid`` is also the rows' group, and the per-row ``dataproto`` field holds the layout, on the
  first row ``meta_info``, and the object values (:mod:`.layout`).

A ``DataProto`` without rows is one row holding only the layout (so a read of it asks for
``len(rows)`` rows, one, not ``len(dp)``: the data plane refuses a read of 0 rows). A
``non_tensor_batch`` array whose leading dims fold the rows (what verl's ``fold_batch_dim``
leaves in the ``DataProto`` it is given: a ``[6]`` batch with ``[3, 2]`` labels) is stored row by
row as its ``[n, ...]`` view, its leading dims on the first row. What cannot be stored exactly (a
value of an arbitrary Python class, a nested ``TensorDict``, masks that disagree with a rollout's
padding, an array that neither has nor folds the rows) raises here, before anything is sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

import tqstream.adapters.verl.padding as padding
from tqstream.adapters.verl.layout import (
    DERIVED_FIELDS,
    LAYOUT_FIELD,
    RESPONSE_FIELDS,
    Layout,
    Rollout,
    head,
)
from tqstream.adapters.verl.objects import encode_headed_rows
from tqstream.errors import BatchShapeError, InvalidRequestError, SchemaError
from tqstream.protocol.columns import Column, dtype_name
from tqstream.types import FieldSchema

__all__ = ["RowBatch", "dataproto_to_rows", "stored_dense", "stored_fields"]

_ROLLOUT = ("prompts", "responses", "attention_mask")
_TORCH_NUMPY = {
    np.dtype(n)
    for n in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RowBatch:
    """One put's worth of rows: ``client.put(rows.data, partition, groups=rows.groups, ...)``.

    ``groups`` are the ``uid`` of each row (None when the ``DataProto`` has no 1-D ``uid``): a
    GRPO group is one prompt's samples, and ``whole_groups`` reads keep them together.
    """

    data: dict[str, Any]
    groups: list[str] | None

    def __len__(self) -> int:
        return int(self.data[LAYOUT_FIELD].n_rows)

    @property
    def fields(self) -> list[str]:
        return list(self.data)


def ragged_column(values: torch.Tensor, offsets: torch.Tensor) -> Column:
    """Rows ``values[offsets[i]:offsets[i + 1]]`` as a column for the put (no nested tensor made
    and taken apart again)."""
    schema = FieldSchema("ragged", dtype_name(values.dtype), tuple(values.shape[1:]))
    return Column(schema, values.contiguous(), offsets)


def stored_fields(keys: Iterable[str], written: Iterable[str]) -> list[str]:
    """The row fields to read for a ``DataProto`` with these keys (batch or non-tensor).

    ``written``: the partition's fields (``client.stats(p).partitions[p].schemas``). A rollout's
    rebuilt tensors come from ``prompts`` and ``responses``, which any of them (or of those two)
    brings; object-valued ``non_tensor_batch`` keys ride in the layout field, which is always
    read, so a key that is not one of ``written`` is not named (:func:`rows_to_dataproto` with
    ``keys=`` says which keys the rows turned out not to have).
    """
    keys, written = list(keys), set(written)
    out: dict[str, None] = {}
    if any(k in _ROLLOUT[:2] or (k in DERIVED_FIELDS and k not in written) for k in keys):
        out.update(dict.fromkeys(_ROLLOUT[:2]))
    out.update(dict.fromkeys(k for k in keys if k in written and k != LAYOUT_FIELD))
    out[LAYOUT_FIELD] = None
    return list(out)


def stored_dense(dtype: np.dtype[Any]) -> bool:
    """Whether a ``non_tensor_batch`` array of this dtype is stored as a dense tensor (numeric
    dtypes torch has) rather than one encoded value per row."""
    return dtype.newbyteorder("=") in _TORCH_NUMPY


# --- DataProto -> rows ---------------------------------------------------------------------------
def dataproto_to_rows(
    data: Any, *, response_fields: Sequence[str] = (), pad_token_id: int | None = None
) -> RowBatch:
    """The rows of a ``DataProto`` (see the module docstring).

    For a rollout: ``response_fields`` names more ``[B, response_length, ...]`` batch fields to
    store unpadded (e.g. ``old_log_probs``, ``advantages``; their padding must be 0, as verl pads
    them); ``pad_token_id`` is the tokenizer's pad id; when None it is read off the padding
    positions (which must then all hold one id). Both are unused for other batches. Raises
    ``SchemaError`` for what cannot be stored exactly and ``InvalidRequestError`` for a rollout's
    masks that disagree with its padding; nothing is sent before.
    """
    batch, non_tensor = _parts(data)
    tensors = _tensors(batch)
    names = set(tensors) | set(non_tensor or {})
    if LAYOUT_FIELD in names:
        raise SchemaError(
            f"the DataProto has a field named {LAYOUT_FIELD!r}, the name of the row layout field "
            f"dataproto_to_rows adds; rename it"
        )
    clash = sorted(set(tensors) & set(non_tensor or {}))
    if clash:
        raise SchemaError(
            f"non_tensor_batch and batch both have {clash}; a row holds one field of each name: "
            f"rename one"
        )
    n = len(data)
    dims = None if batch is None else [int(d) for d in batch.batch_size[1:]]
    if n == 0:
        return _no_rows(dims, tensors, non_tensor, data.meta_info)
    rows: dict[str, Any] = {}
    rollout = None
    if _is_rollout(batch, tensors):
        rollout = _unpad(tensors, rows, response_fields, pad_token_id)
    nested = []
    for key, t in tensors.items():
        if key in rows or (rollout is not None and key in rollout.derived):
            continue
        if t.is_nested:
            nested.append(key)
        rows[key] = t
    layout_non_tensor = None
    objects: dict[str, Sequence[Any]] = {}
    folded: dict[str, list[int]] = {}
    uid = None
    if non_tensor is not None:
        layout_non_tensor = {}
        for key, arr in non_tensor.items():
            arr, lead = _unfolded(arr, n)
            if lead:
                folded[key] = lead
            if key == "uid":
                uid = arr
            field, layout_non_tensor[key] = _non_tensor_field(key, arr)
            if len(field) != n:
                raise BatchShapeError(
                    f"fields disagree on the number of rows: non_tensor_batch[{key!r}] has "
                    f"{len(field)}, the DataProto {n}; every field of a put needs one entry per "
                    f"row (the same leading dimension)",
                    rows={key: len(field), "DataProto": n},
                )
            if isinstance(field, torch.Tensor):
                rows[key] = field
            else:  # the values go in the layout field
                objects[key] = field
    layout = Layout(dims, nested, layout_non_tensor, rollout)
    rows[LAYOUT_FIELD] = _layout_rows(layout, data.meta_info, n, objects, folded)
    groups = None
    if isinstance(uid, np.ndarray) and uid.ndim == 1:
        groups = [str(u) for u in uid.tolist()]
    return RowBatch(rows, groups)


def _parts(data: Any) -> tuple[Any, dict[str, Any] | None]:
    if not all(hasattr(data, a) for a in ("batch", "non_tensor_batch", "meta_info")):
        raise SchemaError(f"dataproto_to_rows needs a verl DataProto, got {type(data).__name__}")
    non_tensor = data.non_tensor_batch
    if non_tensor is not None and not isinstance(non_tensor, dict):
        raise SchemaError(
            f"DataProto.non_tensor_batch is a {type(non_tensor).__name__}; verl holds a dict of "
            f"numpy arrays there"
        )
    return data.batch, non_tensor


def _tensors(batch: Any) -> dict[str, torch.Tensor]:
    """The batch's tensors by name; what is not a tensor (or a jagged one) is refused."""
    from tensordict import TensorDictBase

    if batch is None:
        return {}
    if not isinstance(batch, TensorDictBase):
        raise SchemaError(
            f"DataProto.batch is a {type(batch).__name__}; verl holds a TensorDict there"
        )
    out = {}
    for key, value in batch.items():
        if isinstance(value, TensorDictBase):
            raise SchemaError(
                f"batch[{key!r}] is a nested TensorDict; dataproto_to_rows stores tensors: "
                f"flatten it first (batch.flatten_keys('.'))"
            )
        if not isinstance(value, torch.Tensor):
            raise SchemaError(
                f"batch[{key!r}] is a {type(value).__name__}, not a tensor; keep per-row Python "
                f"values in non_tensor_batch (a numpy object array)"
            )
        if value.is_nested and value.layout != torch.jagged:
            raise SchemaError(
                f"batch[{key!r}] is a nested tensor of layout {value.layout}; store it as "
                f"torch.nested.nested_tensor(rows, layout=torch.jagged)"
            )
        out[key] = value
    return out


def _is_rollout(batch: Any, tensors: dict[str, torch.Tensor]) -> bool:
    """A batch shaped as verl's agent loop pads one: 1-D batch, ``prompts`` ``[B, P]``,
    ``responses`` ``[B, R]``, ``attention_mask`` ``[B, P + R]``."""
    if batch is None or len(batch.batch_size) != 1 or any(k not in tensors for k in _ROLLOUT):
        return False
    prompts, responses, mask = (tensors[k] for k in _ROLLOUT)
    if any(t.is_nested or t.ndim != 2 for t in (prompts, responses, mask)):
        return False
    return mask.shape[1] == prompts.shape[1] + responses.shape[1]


def _unpad(
    tensors: dict[str, torch.Tensor],
    rows: dict[str, Any],
    response_fields: Sequence[str],
    pad_token_id: int | None,
) -> Rollout:
    """Fill ``rows`` with a rollout's unpadded fields (ragged columns), after checking the masks
    and the padding."""
    prompts, responses, mask = (tensors[k] for k in _ROLLOUT)
    p_width, r_width = prompts.shape[1], responses.shape[1]
    p_real, r_real = padding.mask_lengths(mask, p_width)
    p_values, r_values = padding.strip(prompts, p_real), padding.strip(responses, r_real)
    pad = _pad_token(prompts, responses, p_real, r_real, p_values, r_values, pad_token_id)
    _check_prompt_start(p_values, p_real, pad)
    derived = _derived(tensors, p_real, r_real)
    response = [k for k in dict.fromkeys((*RESPONSE_FIELDS, *response_fields)) if k in tensors]
    rows["prompts"] = ragged_column(p_values, p_real.offsets)
    rows["responses"] = ragged_column(r_values, r_real.offsets)
    for key in response:
        rows[key] = _strip_response_field(key, tensors[key], r_real)
    for key, t in tensors.items():  # any other [B, R, ...] tensor: response-aligned
        if key in rows or key in derived or key in _ROLLOUT:
            continue
        if not t.is_nested and t.ndim >= 2 and t.shape[1] == r_width:
            rows[key] = _response_aligned(t, r_real)
            response.append(key)
    return Rollout(p_width, r_width, pad, derived, response)


def _response_aligned(t: torch.Tensor, real: padding.Real) -> Column:
    """A ``[B, R, ...]`` tensor as ragged rows: without its right padding when that is all 0
    bits (``rm_scores``, ``token_level_rewards``, ... as verl pads them), else each row whole (its
    ``R`` positions): re-padding with 0 gives it back either way, bit for bit."""
    values = padding.strip(t, real)
    if padding.padding_is_zero(t, values):
        return ragged_column(values, real.offsets)
    n, width = t.shape[:2]
    whole = torch.arange(0, (n + 1) * width, width, dtype=torch.int64)
    return ragged_column(t.reshape(n * width, *t.shape[2:]), whole)


def _pad_token(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    p_real: padding.Real,
    r_real: padding.Real,
    p_values: torch.Tensor,
    r_values: torch.Tensor,
    pad_token_id: int | None,
) -> int | None:
    """The pad id every padding position holds (checked); inferred when not given: the id at
    the first padding position, which every other one must then hold too."""
    p_width, r_width = prompts.shape[1], responses.shape[1]
    if pad_token_id is None:
        short = (p_real.lengths < p_width).nonzero()
        if len(short):  # left padding: the row's first position
            pad_token_id = int(prompts[int(short[0, 0]), 0])
        else:
            short = (r_real.lengths < r_width).nonzero()
            if not len(short):
                return None
            row = int(short[0, 0])  # right padding: just after the row's tokens
            pad_token_id = int(responses[row, int(r_real.lengths[row])])
        agree = all(
            padding.padding_holds(t, values, pad_token_id)
            for t, values in ((prompts, p_values), (responses, r_values))
        )
        if not agree:
            outside = [padding.numpy_view(t)[~real.keep]
                       for t, real in ((prompts, p_real), (responses, r_real))]  # fmt: skip
            seen = np.unique(np.concatenate(outside))
            raise InvalidRequestError(
                f"the padding positions of prompts/responses (attention_mask 0) hold several "
                f"token ids {seen.tolist()[:8]}, but verl pads with one pad_token_id: the masks "
                f"disagree with the padding (or pass pad_token_id= to find the position)"
            )
        return pad_token_id
    padding.check_padding("prompts", prompts, p_values, p_real, pad_token_id,
                          "left of the prompt")  # fmt: skip
    padding.check_padding("responses", responses, r_values, r_real, pad_token_id,
                          "right of the response")  # fmt: skip
    return pad_token_id


def _check_prompt_start(values: torch.Tensor, real: padding.Real, pad: int | None) -> None:
    """A prompt whose first attended token is the pad id has its mask over the left padding."""
    if pad is None or values.numel() == 0:
        return
    attended = real.lengths > 0
    first = values.index_select(0, real.offsets[:-1][attended])
    bad = first == pad
    if bool(bad.any()):
        row = int(attended.nonzero()[int(bad.nonzero()[0, 0]), 0])
        raise InvalidRequestError(
            f"attention_mask row {row} is 1 over the prompt's left padding (its first attended "
            f"token is the pad id {pad}): the masks disagree with the padding"
        )


def _derived(
    tensors: dict[str, torch.Tensor], p_real: padding.Real, r_real: padding.Real
) -> dict[str, str]:
    """The tensors to rebuild rather than store (name -> dtype): ``attention_mask``, and
    ``input_ids`` / ``position_ids`` when they are what verl computes (``prompts ⧺ responses``,
    ``verl.utils.model.compute_position_id_with_mask``); other ones (e.g. multimodal M-RoPE
    position ids ``[B, 3, L]``) are stored as they are. Compared by value on numpy views."""
    prompts, responses, mask = (tensors[k] for k in _ROLLOUT)
    p_width = prompts.shape[1]
    derived = {"attention_mask": dtype_name(mask.dtype)}
    input_ids = tensors.get("input_ids")
    if _comparable(input_ids, mask.shape, prompts, responses):
        assert input_ids is not None
        ids = padding.numpy_view(input_ids)
        if np.array_equal(ids[:, :p_width], padding.numpy_view(prompts)) and np.array_equal(
            ids[:, p_width:], padding.numpy_view(responses)
        ):
            derived["input_ids"] = dtype_name(input_ids.dtype)
    position_ids = tensors.get("position_ids")
    if _comparable(position_ids, mask.shape):
        assert position_ids is not None
        expected = padding.positions(p_real.lengths, r_real.lengths, p_width, responses.shape[1])
        if np.array_equal(padding.numpy_view(position_ids), expected):
            derived["position_ids"] = dtype_name(position_ids.dtype)
    return derived


def _comparable(t: torch.Tensor | None, shape: Any, *others: torch.Tensor) -> bool:
    """Whether ``t`` is a ``shape`` tensor numpy compares by value with ``others``."""
    return (
        t is not None
        and not t.is_nested
        and t.shape == shape
        and all(padding.bits_of(x.dtype) is None for x in (t, *others))
    )


def _strip_response_field(key: str, t: torch.Tensor, real: padding.Real) -> Column:
    r_width = real.keep.shape[1]
    if t.ndim < 2 or t.shape[1] != r_width:
        raise InvalidRequestError(
            f"{key} has shape {list(t.shape)} but responses is {r_width} tokens wide: a "
            f"response-aligned field has one entry per response position"
        )
    values = padding.strip(t, real)
    padding.check_padding(key, t, values, real, 0, "beyond the response")
    return ragged_column(values, real.offsets)


def _unfolded(arr: Any, n: int) -> tuple[Any, list[int]]:
    """A ``non_tensor_batch`` array whose leading dims fold the ``n`` rows (``[d1, ..., dk, ...]``
    with ``d1 * ... * dk == n``, ``k >= 2``: what verl's ``fold_batch_dim`` leaves in the
    ``DataProto`` it is given, whose arrays it reshapes in place) as its ``[n, ...]`` view, with
    those dims (``[]`` for any other array, returned as it is)."""
    if not isinstance(arr, np.ndarray) or arr.ndim < 2 or arr.shape[0] == n:
        return arr, []
    rows = arr.shape[0]
    for k in range(1, arr.ndim):
        rows *= arr.shape[k]
        if rows == n:
            return arr.reshape(n, *arr.shape[k + 1 :]), list(arr.shape[: k + 1])
        if rows > n or rows == 0:
            break
    return arr, []


def _non_tensor_field(key: str, arr: Any) -> tuple[torch.Tensor | Sequence[Any], list[Any]]:
    """A ``non_tensor_batch`` array as a dense field or as the values to encode (one per row), and
    its layout entry ``[dtype, trailing]``."""
    if not isinstance(arr, np.ndarray):
        raise SchemaError(
            f"non_tensor_batch[{key!r}] is a {type(arr).__name__}; DataProto holds numpy arrays"
        )
    if arr.ndim == 0:
        raise SchemaError(
            f"non_tensor_batch[{key!r}] is a 0-dim array; it needs one entry per row (shape "
            f"[n, ...])"
        )
    entry = [arr.dtype.str, list(arr.shape[1:])]
    if stored_dense(arr.dtype):
        native = arr.astype(arr.dtype.newbyteorder("="), copy=False)
        return torch.from_numpy(np.ascontiguousarray(native)), entry
    if arr.dtype.kind in "US" or (arr.dtype.kind == "O" and arr.ndim == 1):
        values: Sequence[Any] = arr.tolist()  # str / bytes / the objects themselves
    else:  # n-D object arrays, datetimes, ...: each row a numpy array or scalar
        values = list(arr)
    return values, entry


def _layout_rows(
    layout: Layout,
    meta_info: Any,
    n: int,
    objects: dict[str, Sequence[Any]],
    folded: dict[str, list[int]] | None = None,
) -> Column:
    """The layout field of ``n`` rows (the first carries ``meta_info`` and the ``folded`` arrays'
    leading dims) with their object values, ragged ``uint8`` (see :mod:`.layout`)."""
    first = head(layout.encode(meta_info, first=True, folded=folded))
    rest = head(layout.encode())
    return encode_headed_rows([first, *[rest] * (n - 1)], objects)


def _no_rows(
    dims: list[int] | None,
    tensors: dict[str, torch.Tensor],
    non_tensor: dict[str, Any] | None,
    meta_info: Any,
) -> RowBatch:
    """A ``DataProto`` without rows: one row of layout, with its tensors' dtypes and shapes."""
    skip = 1 + len(dims or [])
    empty = {}
    for key, t in tensors.items():
        shape = t.values().shape[1:] if t.is_nested else t.shape[skip:]
        empty[key] = [dtype_name(t.dtype), list(shape)]
    nested = [k for k, t in tensors.items() if t.is_nested]
    layout_non_tensor = None
    if non_tensor is not None:
        layout_non_tensor = {}
        for key, arr in non_tensor.items():
            if not isinstance(arr, np.ndarray) or arr.ndim == 0:
                raise SchemaError(f"non_tensor_batch[{key!r}] is not an array of rows")
            layout_non_tensor[key] = [arr.dtype.str, list(arr.shape[1:])]
    layout = Layout(dims, nested, layout_non_tensor, None, empty)
    return RowBatch({LAYOUT_FIELD: _layout_rows(layout, meta_info, 1, {})}, None)
