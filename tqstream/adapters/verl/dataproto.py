"""verl ``DataProto`` → tqstream rows (:mod:`.rebuild` goes back).

``dataproto_to_rows`` turns a rollout ``DataProto`` into one put's worth of rows: ``prompts``
without their left padding, ``responses`` and the response-aligned fields (``response_mask``,
``rollout_log_probs``, any ``response_fields=``) without their right padding (ragged fields, so no
byte of padding is stored and rows of batches padded to different widths mix), every other batch
tensor as it is (dense), each ``non_tensor_batch`` array as a field of its own (object arrays as
JSON/str fields, numeric arrays as dense tensors), ``uid`` as the rows' group, and the per-row
``dataproto`` layout (:mod:`.layout`). ``input_ids``, ``attention_mask`` and ``position_ids`` are
not stored: they are checked against the padding here and rebuilt by ``rows_to_dataproto``, which
re-pads to the widths the trainer asks for. Converting a put's rows back gives an equal
``DataProto`` (``batch``, ``non_tensor_batch`` with its dtypes, ``meta_info``), which is why
everything that would not come back identically is refused here.
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
    json_problem,
)
from tqstream.errors import InvalidRequestError, SchemaError
from tqstream.protocol.codec import dtype_name

__all__ = ["RowBatch", "dataproto_to_rows", "stored_fields"]

_REQUIRED = ("prompts", "responses", "attention_mask")


@dataclasses.dataclass(frozen=True)
class RowBatch:
    """One put's worth of rows: ``client.put(rows.data, partition, groups=rows.groups, ...)``.

    ``groups`` are the ``uid`` of each row (None when the ``DataProto`` has no ``uid``): a GRPO
    group is one prompt's samples, and ``whole_groups`` reads keep them together.
    """

    data: dict[str, Any]
    groups: list[str] | None

    def __len__(self) -> int:
        return len(self.data[LAYOUT_FIELD])

    @property
    def fields(self) -> list[str]:
        return list(self.data)


def stored_fields(keys: Iterable[str]) -> list[str]:
    """The row fields to read for a ``DataProto`` with these keys (batch or non-tensor): the
    derived ones are rebuilt from ``prompts`` and ``responses``, and the layout is always read."""
    out = dict.fromkeys(["prompts", "responses"])
    out.update(dict.fromkeys(k for k in keys if k not in DERIVED_FIELDS and k != LAYOUT_FIELD))
    out[LAYOUT_FIELD] = None
    return list(out)


# --- DataProto -> rows ---------------------------------------------------------------------------
def dataproto_to_rows(
    data: Any, *, response_fields: Sequence[str] = (), pad_token_id: int | None = None
) -> RowBatch:
    """The rows of a rollout ``DataProto`` (see the module docstring), after checking that its
    masks agree with its padding.

    ``response_fields``: more ``[B, response_length, ...]`` batch fields to store unpadded (e.g.
    ``old_log_probs``, ``advantages``); their padding must be 0, as verl pads them.
    ``pad_token_id``: the tokenizer's pad id; when None it is read off the padding positions
    (which must then all hold one id). Raises ``SchemaError`` for a structure verl's rollout does
    not produce and ``InvalidRequestError`` for masks that disagree with the padding.
    """
    batch = _batch_of(data)
    prompts, responses, mask = (batch.get(k) for k in _REQUIRED)
    p_width, r_width = _widths(prompts, responses, mask)
    p_len, _ = padding.mask_lengths(mask, p_width)
    p_keep, r_keep = mask[:, :p_width] != 0, mask[:, p_width:] != 0
    pad = _pad_token(prompts, responses, p_keep, r_keep, pad_token_id)
    _check_prompt_start(prompts, p_keep, p_len, pad)
    derived = _check_derived(batch, prompts, responses, mask)
    names = list(batch.keys())
    response = [k for k in (*RESPONSE_FIELDS, *response_fields) if k in names]
    rows: dict[str, Any] = {
        "prompts": padding.strip(prompts, p_keep),
        "responses": padding.strip(responses, r_keep),
    }
    for key in dict.fromkeys(response):
        rows[key] = _strip_response_field(key, batch.get(key), r_keep, r_width)
    for key in names:
        if key not in rows and key not in DERIVED_FIELDS:
            rows[key] = batch.get(key)
    non_tensor = _non_tensor_fields(data.non_tensor_batch, rows)
    rows.update(non_tensor)
    layout = Layout(
        prompt_length=p_width,
        response_length=r_width,
        pad_token_id=pad,
        derived=derived,
        response=list(dict.fromkeys(response)),
        non_tensor={k: v.dtype.str for k, v in non_tensor.items()},
    )
    meta = dict(data.meta_info or {})
    _check_json("meta_info", meta)
    n = len(prompts)
    rest = layout.to_json()
    rows[LAYOUT_FIELD] = [layout.to_json(meta)] + [rest] * (n - 1) if n else []
    uid = non_tensor.get("uid")
    groups = None if uid is None else [str(u) for u in uid.tolist()]
    return RowBatch(rows, groups)


def _batch_of(data: Any) -> Any:
    batch = getattr(data, "batch", None)
    if batch is None or not hasattr(data, "non_tensor_batch"):
        raise SchemaError(
            f"dataproto_to_rows needs a verl DataProto with a batch (got {type(data).__name__}"
            f"{' without a batch' if hasattr(data, 'non_tensor_batch') else ''})"
        )
    names = list(batch.keys())
    missing = [k for k in _REQUIRED if k not in names]
    if missing:
        raise SchemaError(
            f"the DataProto has no {missing} in its batch (it has {sorted(names)}); "
            f"dataproto_to_rows stores rollouts as verl's agent loop returns them: left-padded "
            f"prompts, right-padded responses and their attention_mask"
        )
    return batch


def _widths(prompts: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    for name, t in (("prompts", prompts), ("responses", responses)):
        if t.ndim != 2:
            raise SchemaError(f"{name} must be [batch, length] token ids, got {list(t.shape)}")
    p_width, r_width = prompts.shape[1], responses.shape[1]
    if mask.ndim != 2 or mask.shape[1] != p_width + r_width:
        raise SchemaError(
            f"attention_mask has shape {list(mask.shape)} but prompts ⧺ responses is "
            f"[{len(prompts)}, {p_width} + {r_width}]: one mask entry per token"
        )
    return p_width, r_width


def _pad_token(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    p_keep: torch.Tensor,
    r_keep: torch.Tensor,
    pad_token_id: int | None,
) -> int | None:
    """The pad id every padding position holds (checked); inferred when not given."""
    if pad_token_id is None:
        seen = torch.cat([prompts[~p_keep], responses[~r_keep]]).unique()
        if seen.numel() > 1:
            raise InvalidRequestError(
                f"the padding positions of prompts/responses (attention_mask 0) hold several "
                f"token ids {seen.tolist()[:8]}, but verl pads with one pad_token_id: the masks "
                f"disagree with the padding (or pass pad_token_id= to find the position)"
            )
        pad_token_id = int(seen[0]) if seen.numel() else None
        if pad_token_id is None:
            return None
    padding.check_padding("prompts", prompts, p_keep, pad_token_id, "left of the prompt")
    padding.check_padding("responses", responses, r_keep, pad_token_id, "right of the response")
    return pad_token_id


def _check_prompt_start(
    prompts: torch.Tensor, p_keep: torch.Tensor, p_len: torch.Tensor, pad: int | None
) -> None:
    """A prompt whose first attended token is the pad id has its mask over the left padding."""
    if pad is None or prompts.shape[1] == 0:
        return
    first = prompts.gather(1, (prompts.shape[1] - p_len).clamp(max=prompts.shape[1] - 1)[:, None])
    bad = (first[:, 0] == pad) & (p_len > 0)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise InvalidRequestError(
            f"attention_mask row {row} is 1 over the prompt's left padding (its first attended "
            f"token is the pad id {pad}): the masks disagree with the padding"
        )


def _check_derived(
    batch: Any, prompts: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor
) -> dict[str, str]:
    """Check the tensors rebuilt on the way back against what they will be rebuilt as."""
    from verl.utils.model import compute_position_id_with_mask

    derived = {"attention_mask": dtype_name(mask.dtype)}
    names = list(batch.keys())
    if "input_ids" in names:
        input_ids = batch.get("input_ids")
        expected = torch.cat([prompts, responses], dim=1)
        if input_ids.shape != expected.shape or not torch.equal(input_ids, expected.to(input_ids)):
            raise InvalidRequestError(
                f"input_ids ({list(input_ids.shape)}) is not prompts ⧺ responses "
                f"({list(expected.shape)}); verl builds input_ids as their concatenation"
            )
        derived["input_ids"] = dtype_name(input_ids.dtype)
    if "position_ids" in names:
        position_ids = batch.get("position_ids")
        if position_ids.shape != mask.shape:
            raise SchemaError(
                f"position_ids has shape {list(position_ids.shape)}, not the attention_mask's "
                f"{list(mask.shape)}: multimodal (M-RoPE) position ids are not rebuilt from the "
                f"mask, so dataproto_to_rows cannot store them; drop them before the put"
            )
        expected = compute_position_id_with_mask(mask.to(torch.int64))
        if not torch.equal(position_ids.to(torch.int64), expected):
            row = int((position_ids.to(torch.int64) != expected).any(dim=1).nonzero()[0, 0])
            raise InvalidRequestError(
                f"position_ids row {row} is not cumsum(attention_mask) - 1 clipped at 0 "
                f"(verl.utils.model.compute_position_id_with_mask): the masks disagree with the "
                f"positions"
            )
        derived["position_ids"] = dtype_name(position_ids.dtype)
    return derived


def _strip_response_field(
    key: str, t: torch.Tensor, r_keep: torch.Tensor, r_width: int
) -> list[torch.Tensor]:
    if t.ndim < 2 or t.shape[1] != r_width:
        raise InvalidRequestError(
            f"{key} has shape {list(t.shape)} but responses is {r_width} tokens wide: a "
            f"response-aligned field has one entry per response position"
        )
    padding.check_padding(key, t, r_keep, 0, "beyond the response")
    return padding.strip(t, r_keep)


def _non_tensor_fields(non_tensor: dict[str, Any], taken: dict[str, Any]) -> dict[str, Any]:
    """Each ``non_tensor_batch`` array as a field (the array itself: the client stores object
    arrays as str/bytes/JSON fields and numeric arrays as dense tensors)."""
    out: dict[str, Any] = {}
    for key, arr in (non_tensor or {}).items():
        if key in taken or key in DERIVED_FIELDS or key == LAYOUT_FIELD:
            raise SchemaError(
                f"non_tensor_batch[{key!r}] has the name of a batch field or of the row layout "
                f"field {LAYOUT_FIELD!r}; rename it"
            )
        if not isinstance(arr, np.ndarray):
            raise SchemaError(
                f"non_tensor_batch[{key!r}] is a {type(arr).__name__}; DataProto holds numpy arrays"
            )
        if arr.dtype.kind in "OUS":
            if arr.ndim != 1:
                raise SchemaError(
                    f"non_tensor_batch[{key!r}] is a {arr.ndim}-D {arr.dtype} array; object and "
                    f"string arrays are stored one value per row: make it 1-D (an object array "
                    f"of per-row lists)"
                )
            if arr.dtype.kind == "O":
                _check_objects(key, arr)
        out[key] = arr
    return out


def _check_objects(key: str, arr: np.ndarray) -> None:
    values = arr.tolist()
    if all(type(v) is str for v in values) or all(type(v) is bytes for v in values):
        return
    for row, value in enumerate(values):
        problem = "bytes among other values" if type(value) is bytes else json_problem(value)
        if problem is not None:
            raise SchemaError(
                f"non_tensor_batch[{key!r}] row {row} holds {problem}, which would not come back "
                f"as it was put; object arrays hold str, bytes or JSON values (None, bool, int, "
                f"finite float, str, list, dict with str keys): convert it first"
            )


def _check_json(name: str, value: dict[str, Any]) -> None:
    problem = json_problem(value)
    if problem is not None:
        raise SchemaError(
            f"{name} holds {problem}, which would not come back as it was put; keep meta_info to "
            f"JSON values (None, bool, int, finite float, str, list, dict with str keys)"
        )
