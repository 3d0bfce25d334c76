"""What a row needs to become part of a ``DataProto`` again: the per-row ``dataproto`` field.

A ``DataProto`` is more than its tensors: whether ``batch`` and ``non_tensor_batch`` exist at all,
the batch dims, which batch tensors are jagged, which ``non_tensor_batch`` arrays a field came from
with their numpy dtypes and trailing shapes (an ``int32`` array, a ``<U5`` string array or a 2-D
object array must come back as one), ``meta_info``, and, for a rollout stored unpadded, the padded
widths, the pad token and the tensors rebuilt rather than stored (``input_ids``,
``attention_mask``, ``position_ids``). Each row carries that as a small map in the object codec of
:mod:`.objects`, so that any selection of rows (a trainer's batch mixes puts) can be turned back
into a ``DataProto``. ``meta_info`` describes the whole put, not a row, so only the first row of a
put carries it; a batch holding the first rows of several puts merges theirs as
``DataProto.concat`` does. So does the fold of ``non_tensor_batch`` arrays whose leading dims fold
the put's rows (what verl's ``fold_batch_dim`` leaves in the ``DataProto`` it is given: a ``[6]``
batch with ``[3, 2]`` labels): the rows hold such an array row by row, as its ``[n, ...]`` view,
and the first row its leading dims (``folded``), which give it its shape back when the rows read
are one put's, as many as it had; any other selection of rows gets it row by row.

The field (ragged ``uint8``) holds two values per row: the layout's bytes as one bin (the *head*:
the same bytes for every row of a put but the first, so a read decodes each distinct layout once)
and a map of the row's object values, ``{non_tensor key: value}`` (nil when the ``DataProto`` has
no object-valued ``non_tensor_batch`` array). Object values ride here, not in a field each,
because every field costs a read and a write its per-column overhead whatever its size, and
object values are small: reading this field (every read does) brings them all.

A ``DataProto`` without rows is one row holding only this field, marked ``empty`` with the dtypes
and shapes of its tensors: it brings its ``meta_info`` and no rows to the ``DataProto`` it is read
into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from tqstream.adapters.verl.objects import pack, unpack
from tqstream.errors import SchemaError

__all__ = [
    "DERIVED_FIELDS",
    "LAYOUT_FIELD",
    "RESPONSE_FIELDS",
    "First",
    "Layout",
    "Merged",
    "Rollout",
    "decode_layouts",
    "head",
    "merge_layouts",
    "merge_meta_info",
]

LAYOUT_FIELD = "dataproto"
"""The per-row field holding the row's :class:`Layout` (ragged ``uint8``, see :mod:`.objects`)."""
RESPONSE_FIELDS = ("response_mask", "rollout_log_probs")
"""Response-aligned batch fields stored without their right padding (besides ``responses``)."""
DERIVED_FIELDS = ("input_ids", "attention_mask", "position_ids")
"""Batch fields of a rollout rebuilt from the rows rather than stored (when they can be)."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A rollout stored unpadded: the padded widths, the pad id, the rebuilt tensors (name ->
    torch dtype name) and the response-aligned fields stored unpadded besides ``responses``."""

    prompt_length: int
    response_length: int
    pad_token_id: int | None
    derived: dict[str, str]
    response: list[str]


class First(NamedTuple):
    """What the first row of a put carries for the whole put: its ``meta_info``, and the leading
    dims of its ``non_tensor_batch`` arrays that fold its rows (key -> dims; see the module
    docstring)."""

    meta_info: Any
    folded: dict[str, list[int]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the rows of one put map onto its ``DataProto`` (see the module docstring).

    ``batch``: None when the ``DataProto`` has no ``batch``, else its batch dims after the first
    (``[]`` for verl's usual one). ``nested``: batch tensors stored as they are, jagged.
    ``non_tensor``: None when ``non_tensor_batch`` is None, else name -> ``[numpy dtype string,
    trailing shape]``. ``rollout``: set when the batch is stored unpadded. ``empty``: only on the
    row of a ``DataProto`` without rows: its batch tensors, name -> ``[dtype name, shape after the
    batch dims]``.
    """

    batch: list[int] | None
    nested: list[str]
    non_tensor: dict[str, list[Any]] | None
    rollout: Rollout | None = None
    empty: dict[str, list[Any]] | None = None

    def encode(
        self,
        meta_info: Any = None,
        *,
        first: bool = False,
        folded: dict[str, list[int]] | None = None,
    ) -> bytes:
        """The row's bytes; the put's first row (``first``) carries ``meta_info`` and the
        ``folded`` arrays' leading dims (written only when there are any, so the bytes of other
        puts are those of the previous release)."""
        rollout = self.rollout
        out: dict[str, Any] = {
            "batch": self.batch,
            "nested": self.nested,
            "non_tensor": self.non_tensor,
            "rollout": None if rollout is None else rollout.__dict__,
            "empty": self.empty,
        }
        if first:
            out["meta_info"] = pack(meta_info, "meta_info")
            if folded:
                out["folded"] = folded
        return pack(out, LAYOUT_FIELD)

    @staticmethod
    def decode(row: int, data: Any) -> tuple[Layout, First | None]:
        """The layout of a read row and, for the first row of a put, what it carries for the
        put."""
        value = unpack(data, LAYOUT_FIELD)
        try:
            rollout = value["rollout"]
            layout = Layout(
                batch=None if value["batch"] is None else [int(d) for d in value["batch"]],
                nested=[str(k) for k in value["nested"]],
                non_tensor=None if value["non_tensor"] is None else dict(value["non_tensor"]),
                rollout=None if rollout is None else Rollout(**rollout),
                empty=None if value["empty"] is None else dict(value["empty"]),
            )
            meta = None
            if "meta_info" in value:
                meta = First(unpack(value["meta_info"], "meta_info"), _folded(value.get("folded")))
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(
                f"row {row}: field {LAYOUT_FIELD!r} is not a verl row layout ({exc!r}); rows read "
                f"with rows_to_dataproto must have been put from a DataProto (dataproto_to_rows)"
            ) from exc
        return layout, meta


def _folded(value: Any) -> dict[str, list[int]]:
    """A first row's ``folded`` entry, checked: key -> dims of at least 1, at least two of them
    (rows put by the previous release have none)."""
    if value is None:
        return {}
    if type(value) is not dict:
        raise TypeError(f"folded is a {type(value).__name__}, not a map")
    out = {}
    for key, dims in value.items():
        if type(key) is not str or type(dims) is not list or len(dims) < 2:
            raise ValueError(f"folded[{key!r}] is not the leading dims of an array: {dims!r}")
        if not all(type(d) is int and d >= 1 for d in dims):
            raise ValueError(f"folded[{key!r}] holds a dim that is not a positive int: {dims!r}")
        out[key] = dims
    return out


def head(layout_bytes: bytes) -> bytes:
    """A row's first value: its layout's bytes (:meth:`Layout.encode`) as one msgpack bin."""
    return msgpack.packb(layout_bytes, use_bin_type=True)


def decode_layouts(heads: Sequence[Any]) -> list[tuple[Layout, First | None]]:
    """:meth:`Layout.decode` of each row's head (its layout's bytes); rows of one put share their
    bytes (all but the first), so each distinct value is decoded once."""
    seen: dict[bytes, tuple[Layout, First | None]] = {}
    out = []
    for row, data in enumerate(heads):
        if type(data) is not bytes:
            raise SchemaError(
                f"row {row}: field {LAYOUT_FIELD!r} does not start with a verl row layout (got "
                f"{type(data).__name__}); rows read with rows_to_dataproto must have been put from "
                f"a DataProto (dataproto_to_rows)"
            )
        if data not in seen:
            seen[data] = Layout.decode(row, data)
        out.append(seen[data])
    return out


@dataclasses.dataclass(frozen=True)
class Merged:
    """The layouts of a batch's rows, merged: what ``rows_to_dataproto`` rebuilds.

    ``rows``: the rows that hold data (not the row of a ``DataProto`` without rows).
    ``non_tensor``: name -> (numpy dtype, trailing shape). ``empty``: the batch tensors of a
    batch of ``DataProto``s without rows (``rows`` is then empty). ``folded``: the leading dims
    of the arrays that fold the rows, when the batch holds the first row of one put only (the
    rebuild folds them when it holds as many rows as that put).
    """

    rows: list[int]
    batch: list[int] | None
    nested: set[str]
    non_tensor: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] | None
    rollout: Rollout | None
    empty: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    meta_infos: list[Any]
    folded: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def merge_layouts(layouts: Sequence[tuple[Layout, First | None]]) -> Merged:
    """One layout for a batch whose rows may come from several puts.

    Widths take the widest put (as re-padding needs); string dtypes the widest too (what
    ``np.concatenate`` of the puts' arrays would give); everything else must agree, or the puts
    did not come from one kind of ``DataProto``. Rows of ``DataProto``s without rows add only
    their ``meta_info``, unless nothing else was read.
    """
    from tqstream.protocol.columns import torch_dtype

    firsts = [meta for _, meta in layouts if meta is not None]
    metas = [first.meta_info for first in firsts]
    rows = [i for i, (lay, _) in enumerate(layouts) if lay.empty is None]
    # one per distinct layout (decode_layouts gives the rows of a put the same object)
    used = list(
        {
            id(lay): lay for lay in ([layouts[i][0] for i in rows] or [lay for lay, _ in layouts])
        }.values()
    )
    if not used:
        return Merged([], [], set(), {}, None, {}, metas)
    first = used[0]
    for lay in used:
        if lay.batch != first.batch or (lay.rollout is None) != (first.rollout is None):
            raise SchemaError(
                f"the rows read come from DataProtos of different kinds ({_kind(first)} vs "
                f"{_kind(lay)}); read rows of one kind of DataProto together"
            )
    empty: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    if not rows:
        for lay in used:
            for key, (dtype, shape) in (lay.empty or {}).items():
                empty.setdefault(key, (torch_dtype(dtype), tuple(shape)))
    return Merged(
        rows=rows,
        batch=first.batch,
        nested={k for lay in used for k in lay.nested},
        non_tensor=_merge_non_tensor(used),
        rollout=_merge_rollout([lay.rollout for lay in used if lay.rollout is not None]),
        empty=empty,
        meta_infos=metas,
        folded=firsts[0].folded if len(firsts) == 1 else {},
    )


def _kind(lay: Layout) -> str:
    batch = "no batch" if lay.batch is None else f"batch dims [n, *{lay.batch}]"
    return f"{batch}, {'a rollout stored unpadded' if lay.rollout else 'dense'}"


def _merge_rollout(rollouts: list[Rollout]) -> Rollout | None:
    if not rollouts:
        return None
    first = rollouts[0]
    for lay in rollouts:
        if lay.derived != first.derived:
            raise SchemaError(
                f"the rows read were put from DataProtos with different rebuilt tensors "
                f"({first.derived} vs {lay.derived}); read rows of one kind of DataProto together"
            )
    pads = [lay.pad_token_id for lay in rollouts if lay.pad_token_id is not None]
    return Rollout(
        prompt_length=max(lay.prompt_length for lay in rollouts),
        response_length=max(lay.response_length for lay in rollouts),
        pad_token_id=pads[0] if pads else None,
        derived=dict(first.derived),
        response=list(dict.fromkeys(k for lay in rollouts for k in lay.response)),
    )


def _merge_non_tensor(
    layouts: list[Layout],
) -> dict[str, tuple[np.dtype[Any], tuple[int, ...]]] | None:
    if all(lay.non_tensor is None for lay in layouts):
        return None
    found: dict[str, dict[tuple[str, tuple[int, ...]], None]] = {}
    for lay in layouts:
        for key, (dt, shape) in (lay.non_tensor or {}).items():
            found.setdefault(key, {})[(str(dt), tuple(shape))] = None
    return {key: _one_dtype(key, list(kinds)) for key, kinds in found.items()}


def _one_dtype(
    key: str, kinds: list[tuple[str, tuple[int, ...]]]
) -> tuple[np.dtype[Any], tuple[int, ...]]:
    dts = [np.dtype(dt) for dt, _ in kinds]
    shapes = {shape for _, shape in kinds}
    if len(shapes) == 1:
        if len(set(dts)) == 1:
            return dts[0], kinds[0][1]
        if {dt.kind for dt in dts} in ({"U"}, {"S"}):
            return max(dts, key=lambda dt: dt.itemsize), kinds[0][1]
    described = sorted({f"{dt} {list(shape)}" for dt, shape in kinds})
    raise SchemaError(
        f"non_tensor_batch[{key!r}] was put with different numpy dtypes or trailing shapes "
        f"{described}; rows read together must agree on them (np.concatenate would change them)"
    )


def merge_meta_info(metas: list[Any]) -> Any:
    """The ``meta_info`` of a batch: the put's own for one put, else verl's ``DataProto.concat``
    merge (per-worker ``metrics`` gathered, other keys must agree)."""
    if not metas:
        return {}
    if len(metas) == 1:
        return metas[0]
    from verl.protocol import DataProto

    try:
        return dict(DataProto.concat([DataProto(meta_info=m or {}) for m in metas]).meta_info)
    except (AssertionError, ValueError) as exc:  # verl asserts that non-metric keys agree
        raise SchemaError(
            f"the batch holds rows of {len(metas)} puts whose meta_info cannot be merged the way "
            f"DataProto.concat merges them ({exc}); read the puts separately"
        ) from exc
