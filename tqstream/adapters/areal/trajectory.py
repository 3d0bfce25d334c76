"""AReaL trajectories ⇄ tqstream rows. Pure tensor code: no client, no AReaL import.

An AReaL workflow returns one episode as a dict of right-padded tensors: ``[n, L]`` for the ``n``
samples of a group (``[1, L]`` for one trajectory), ``attention_mask`` marking the real tokens.
Padding is an artefact of batching, so rows are stored without it: every ``[n, L, ...]`` field
becomes one ragged row per sample, cut to that sample's length; ``[n, ...]`` fields (``rewards``)
stay dense. ``attention_mask`` itself is not stored — it is exactly the rows' lengths — and comes
back as a bool tensor when a group is re-padded, as AReaL's ``concat_padded_tensors`` pads it.

A tensor is per-token when its first two dims are ``[n, L]`` (``L`` = ``input_ids.shape[1]``):
that is how AReaL's own padding helpers decide which dims to pad.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tqstream.errors import GroupError, SchemaError

__all__ = ["Rows", "regroup", "to_rows"]

REQUIRED = ("input_ids", "attention_mask")
MASK = "attention_mask"

# field name -> list of per-row ragged tensors, or one dense [n, ...] tensor
Rows = dict[str, list[torch.Tensor] | torch.Tensor]


def _lengths(traj: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """Per-row token counts from ``attention_mask``, which must be right-padded (ones, then
    zeros): anything else would be silently truncated by unpadding."""
    missing = [k for k in REQUIRED if k not in traj]
    if missing:
        raise SchemaError(
            f"an AReaL trajectory needs {list(REQUIRED)} as [n, L] tensors; it lacks {missing} "
            f"(it has {sorted(traj)}); return them from arun_episode as AReaL's workflows do",
            missing=missing,
        )
    ids, mask = traj["input_ids"], traj[MASK]
    for name, t in (("input_ids", ids), (MASK, mask)):
        if not isinstance(t, torch.Tensor) or t.ndim != 2:
            what = f"a {t.ndim}-d tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise SchemaError(
                f"{name!r} must be an [n, L] tensor (n samples, L padded tokens), got {what}; "
                f"use t.unsqueeze(0) for a single trajectory",
                field=name,
            )
    if mask.shape != ids.shape:
        raise SchemaError(
            f"attention_mask has shape {list(mask.shape)} but input_ids {list(ids.shape)}; "
            f"they must match",
            field=MASK,
        )
    n, width = ids.shape
    if n == 0:
        raise SchemaError("the trajectory has 0 samples (input_ids is [0, L])", field="input_ids")
    real = mask.to(torch.bool)
    lengths = real.sum(dim=1)
    if not torch.equal(real, torch.arange(width) < lengths[:, None]):
        bad = int((real != (torch.arange(width) < lengths[:, None])).any(dim=1).nonzero()[0])
        raise SchemaError(
            f"attention_mask row {bad} is not right-padded (ones, then zeros): "
            f"{real[bad].int().tolist()}; AReaL trajectories are right-padded",
            field=MASK,
        )
    return lengths, width


def _field(name: str, value: Any, lengths: torch.Tensor, width: int) -> list[torch.Tensor] | Any:
    n = len(lengths)
    if not isinstance(value, torch.Tensor):
        raise SchemaError(
            f"field {name!r} is a {type(value).__name__}: the AReaL adapter stores tensor fields "
            f"only ([n, L, ...] per token or [n, ...] per sample); drop it or make it a tensor",
            field=name,
        )
    if value.ndim >= 2 and tuple(value.shape[:2]) == (n, width):
        return [value[i, :k] for i, k in enumerate(lengths.tolist())]
    if value.ndim >= 1 and value.shape[0] == n:
        return value
    raise SchemaError(
        f"field {name!r} has shape {list(value.shape)}; with input_ids of shape [{n}, {width}] a "
        f"field must be [{n}, {width}, ...] (per token) or [{n}, ...] (per sample)",
        field=name,
    )


def _one(traj: Mapping[str, Any]) -> Rows:
    if not isinstance(traj, Mapping):
        raise SchemaError(
            f"an AReaL trajectory is a dict of tensors, got {type(traj).__name__}",
        )
    lengths, width = _lengths(traj)
    return {k: _field(k, v, lengths, width) for k, v in traj.items() if k != MASK}


def _describe(value: list[torch.Tensor] | torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """dtype and trailing (per-row, per-token) shape: what one row's schema is made of."""
    t = value[0] if isinstance(value, list) else value  # [len, ...] or [n, ...]
    return str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])


def _check_keys(data: Sequence[Any]) -> None:
    keys = [set(d) if isinstance(d, Mapping) else None for d in data]
    for i, k in enumerate(keys[1:], 1):
        if k is not None and keys[0] is not None and k != keys[0]:
            raise GroupError(
                f"group member {i} has fields {sorted(k)} but member 0 has {sorted(keys[0])}; "
                f"every sample of a group must carry the same fields",
                member=i,
            )


def _check_members(members: Sequence[Rows]) -> None:
    first = members[0]
    for i, m in enumerate(members[1:], 1):
        for name in first:
            kinds = isinstance(first[name], list), isinstance(m[name], list)
            if kinds[0] != kinds[1] or _describe(first[name]) != _describe(m[name]):
                a, b = _describe(first[name]), _describe(m[name])
                per = ("per sample", "per token")
                raise GroupError(
                    f"group members disagree on field {name!r}: member 0 has {a[0]} "
                    f"{list(a[1])} {per[kinds[0]]}, member {i} has {b[0]} {list(b[1])} "
                    f"{per[kinds[1]]}; every sample of a group must give it the same dtype and "
                    f"shape",
                    member=i,
                    field=name,
                )


def to_rows(data: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> tuple[Rows, int]:
    """One group's rows from an episode result: a padded ``[n, L]`` dict, or a list of per-sample
    dicts (``[1, L_i]`` or ``[k, L_i]`` each, members of one group). Returns ``(rows, n)``.

    Raises ``SchemaError`` for a malformed trajectory and ``GroupError`` for members that
    disagree on fields, before anything is sent.
    """
    if isinstance(data, Mapping):
        rows = _one(data)
        return rows, len(data["input_ids"])
    if not isinstance(data, Sequence) or isinstance(data, str | bytes) or not data:
        raise SchemaError(
            f"put_experience takes an AReaL trajectory dict ([n, L] tensors) or a non-empty list "
            f"of them (the samples of one group), got {type(data).__name__}",
        )
    _check_keys(data)
    members = [_one(d) for d in data]
    _check_members(members)
    out: Rows = {}
    for name, first in members[0].items():
        if isinstance(first, list):
            out[name] = [row for m in members for row in m[name]]
        else:
            out[name] = torch.cat([m[name] for m in members])  # type: ignore[misc]
    return out, sum(len(d["input_ids"]) for d in data)


def regroup(
    data: Mapping[str, torch.Tensor], groups: Sequence[str | None], fields: Sequence[str]
) -> list[dict[str, torch.Tensor]]:
    """Split a padded batch (``get(..., padded=True)``: ``[B, W, ...]`` + ``<field>_lengths``)
    into one dict per group, each re-padded to its own longest sample and carrying a bool
    ``attention_mask`` — what ``concat_padded_tensors`` returns for the group's trajectories.

    ``fields`` must include ``input_ids``: its lengths are every per-token field's lengths, since
    a row's per-token fields were all cut to its length at put. ``groups`` is the batch's group id
    per row; a whole-groups read returns each group's rows contiguously, so a group is a run of
    equal ids. The tensors may be views of the read's buffers, which are private to it (padded
    fields are built for this read; dense ones are copy-on-write views of the stored rows).
    """
    lengths = data["input_ids_lengths"]
    keys = set(data.keys())
    out = []
    start = 0
    for end in _run_ends(groups):
        n = lengths[start:end]
        width = int(n.max())
        group: dict[str, torch.Tensor] = {}
        for name in fields:
            t = data[name][start:end]
            group[name] = (t[:, :width] if f"{name}_lengths" in keys else t).contiguous()
        group[MASK] = torch.arange(width) < n[:, None]
        out.append(group)
        start = end
    return out


def _run_ends(groups: Sequence[str | None]) -> list[int]:
    """End index of each run of equal group ids (rows without a group are runs of one)."""
    return [
        i
        for i in range(1, len(groups) + 1)
        if i == len(groups) or groups[i] is None or groups[i] != groups[i - 1]
    ]
