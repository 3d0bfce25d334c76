"""What a row needs to become part of a ``DataProto`` again: the per-row ``dataproto`` field.

A ``DataProto`` is more than its tensors: the padded widths, the pad token, the dtypes of the
tensors that are rebuilt rather than stored (``input_ids``, ``attention_mask``, ``position_ids``),
which ``non_tensor_batch`` arrays a field came from and their numpy dtypes (an ``int32`` array or a
``<U5`` string array must come back as one), and ``meta_info``. Each row carries that as a small
JSON object, so that any selection of rows (a trainer's batch mixes puts) can be turned back into a
``DataProto``. ``meta_info`` describes the whole put, not a row, so only the first row of a put
carries it; a batch holding the first rows of several puts merges theirs as ``DataProto.concat``
does. Values that JSON would not give back identically (tuples, NaN, numpy scalars, non-str keys)
are refused here, where the mistake is made, rather than coming back different.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tqstream.errors import SchemaError

__all__ = [
    "DERIVED_FIELDS",
    "LAYOUT_FIELD",
    "RESPONSE_FIELDS",
    "Layout",
    "Merged",
    "json_problem",
    "merge_layouts",
    "merge_meta_info",
]

LAYOUT_FIELD = "dataproto"
"""The per-row object field holding the row's :class:`Layout` (a JSON object)."""
RESPONSE_FIELDS = ("response_mask", "rollout_log_probs")
"""Response-aligned batch fields stored without their right padding (besides ``responses``)."""
DERIVED_FIELDS = ("input_ids", "attention_mask", "position_ids")
"""Batch fields rebuilt from the rows rather than stored."""

_INT_RANGE = (-(2**63), 2**64)  # what msgspec encodes as a JSON integer


def json_problem(value: Any) -> str | None:
    """Why ``value`` would not come back identical through JSON (None: it would).

    Types are checked exactly (``type(v) is str``), since verl compares ``non_tensor_batch``
    elements by type too: a ``numpy.float64`` or a ``str`` subclass would come back as a plain
    float or str.
    """
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return None
    if kind is int:
        lo, hi = _INT_RANGE
        return None if lo <= value < hi else f"the int {value} (beyond 64 bits)"
    if kind is float:
        if math.isfinite(value):
            return None
        return f"the float {value!r} (JSON has no NaN or infinity: it would come back as None)"
    if kind is list:
        return next((p for p in map(json_problem, value) if p is not None), None)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return f"the dict key {key!r} ({type(key).__name__}; JSON keys come back as str)"
            problem = json_problem(item)
            if problem is not None:
                return problem
        return None
    if kind is tuple:
        return "a tuple (it would come back as a list)"
    return f"a {kind.__module__}.{kind.__qualname__} value {value!r:.60}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the rows of one put map onto its ``DataProto`` (see the module docstring).

    ``derived``: rebuilt tensors present in the put, name -> torch dtype name. ``response``:
    response-aligned fields stored unpadded besides ``responses``. ``non_tensor``: the
    ``non_tensor_batch`` keys, name -> numpy dtype string (``"|O"``, ``"<i4"``, ``"<U5"``).
    """

    prompt_length: int
    response_length: int
    pad_token_id: int | None
    derived: dict[str, str]
    response: list[str]
    non_tensor: dict[str, str]

    def to_json(self, meta_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if meta_info is not None:
            out["meta_info"] = dict(meta_info)
        return out

    @staticmethod
    def from_json(row: int, value: Any) -> tuple[Layout, dict[str, Any] | None]:
        """The layout of a read row and the ``meta_info`` it carries (first rows of puts)."""
        try:
            layout = Layout(
                prompt_length=int(value["prompt_length"]),
                response_length=int(value["response_length"]),
                pad_token_id=value["pad_token_id"],
                derived=dict(value["derived"]),
                response=list(value["response"]),
                non_tensor=dict(value["non_tensor"]),
            )
            meta = value.get("meta_info")
            return layout, None if meta is None else dict(meta)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(
                f"row {row}: field {LAYOUT_FIELD!r} is not a verl row layout ({exc!r}); rows read "
                f"with rows_to_dataproto must have been put from a DataProto (dataproto_to_rows)"
            ) from exc


@dataclasses.dataclass(frozen=True)
class Merged:
    """The layouts of a batch's rows, merged: what ``rows_to_dataproto`` rebuilds."""

    prompt_length: int
    response_length: int
    pad_token_id: int | None
    derived: dict[str, str]
    response: list[str]
    non_tensor: dict[str, np.dtype[Any]]
    meta_infos: list[dict[str, Any]]


def merge_layouts(values: Iterable[Any]) -> Merged:
    """One layout for a batch whose rows may come from several puts.

    Widths take the widest put (as re-padding needs); string dtypes the widest too (what
    ``np.concatenate`` of the puts' arrays would give); everything else must agree, or the puts
    did not come from one kind of ``DataProto``.
    """
    layouts: list[Layout] = []
    metas: list[dict[str, Any]] = []
    for row, value in enumerate(values):
        layout, meta = Layout.from_json(row, value)
        layouts.append(layout)
        if meta is not None:
            metas.append(meta)
    if not layouts:
        return Merged(0, 0, None, {}, [], {}, metas)
    first = layouts[0]
    for row, lay in enumerate(layouts):
        if lay.derived != first.derived:
            raise SchemaError(
                f"rows 0 and {row} were put from DataProtos with different derived tensors "
                f"({first.derived} vs {lay.derived}); read rows of one kind of DataProto together"
            )
    pads = [lay.pad_token_id for lay in layouts if lay.pad_token_id is not None]
    response: dict[str, None] = {}
    dtypes: dict[str, set[str]] = {}
    for lay in layouts:
        response.update(dict.fromkeys(lay.response))
        for key, dt in lay.non_tensor.items():
            dtypes.setdefault(key, set()).add(dt)
    return Merged(
        prompt_length=max(lay.prompt_length for lay in layouts),
        response_length=max(lay.response_length for lay in layouts),
        pad_token_id=pads[0] if pads else None,
        derived=dict(first.derived),
        response=list(response),
        non_tensor={key: _one_dtype(key, names) for key, names in dtypes.items()},
        meta_infos=metas,
    )


def _one_dtype(key: str, names: set[str]) -> np.dtype[Any]:
    dts = [np.dtype(n) for n in sorted(names)]
    if len(dts) == 1:
        return dts[0]
    kinds = {dt.kind for dt in dts}
    if kinds in ({"U"}, {"S"}):
        return max(dts, key=lambda dt: dt.itemsize)
    raise SchemaError(
        f"non_tensor_batch[{key!r}] was put with different numpy dtypes {sorted(names)}; rows "
        f"read together must agree on it (np.concatenate would change it)"
    )


def merge_meta_info(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``meta_info`` of a batch: the put's own for one put, else verl's ``DataProto.concat``
    merge (per-worker ``metrics`` gathered, other keys must agree)."""
    if not metas:
        return {}
    if len(metas) == 1:
        return metas[0]
    from verl.protocol import DataProto

    try:
        return dict(DataProto.concat([DataProto(meta_info=m) for m in metas]).meta_info)
    except AssertionError as exc:  # verl asserts that non-metric keys agree
        raise SchemaError(
            f"the batch holds rows of {len(metas)} puts whose meta_info cannot be merged the way "
            f"DataProto.concat merges them ({exc}); read the puts separately"
        ) from exc
