"""verl's padded token layout, both ways: per-row lengths from the mask, strip, re-pad. Pure torch.

verl's rollout (``AgentLoopWorker._agent_loop_postprocess``) pads every trajectory to fixed widths:
``prompts`` ``[B, P]`` left-padded, ``responses`` and the response-aligned fields
(``response_mask``, ``rollout_log_probs``) ``[B, R]`` right-padded, and
``attention_mask`` ``[B, P + R]`` 1 exactly on the real tokens. So the mask alone gives each row's
prompt and response length, and a row is its real tokens plus those two lengths. These functions
check that a mask really has that shape (a hole, or 1s over padding, would make the stripped rows
wrong) and move between the two layouts with a few vectorised ops, never a Python loop over rows.
"""

from __future__ import annotations

import torch

from tqstream.errors import InvalidRequestError, SchemaError

__all__ = [
    "check_padding",
    "keeps",
    "mask_lengths",
    "offsets_of",
    "pad_rows",
    "strip",
]


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def mask_lengths(
    mask: torch.Tensor, prompt_width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's prompt and response length (int64 ``[B]``) from a verl ``attention_mask``, and
    the positions they keep (:func:`keeps`).

    The prompt part must be left-padded (0s, then 1s) and the response part right-padded (1s,
    then 0s), with only 0 and 1 in it: verl builds it so, and anything else means the mask and
    the padding disagree, so stripping by it would keep padding or lose tokens.
    """
    if mask.ndim != 2:
        raise SchemaError(
            f"attention_mask must be [batch, prompt_length + response_length], got shape "
            f"{list(mask.shape)}"
        )
    prompt_len = mask[:, :prompt_width].sum(dim=1, dtype=torch.int64)
    response_len = mask[:, prompt_width:].sum(dim=1, dtype=torch.int64)
    p_keep, r_keep = keeps(prompt_len, response_len, prompt_width, mask.shape[1] - prompt_width)
    if torch.equal(mask, torch.cat([p_keep, r_keep], dim=1).to(mask.dtype)):
        return prompt_len, response_len, p_keep, r_keep  # the common case: one comparison
    binary = (mask == 0) | (mask == 1)
    if not bool(binary.all()):
        row = _first_bad_row(~binary.all(dim=1))
        raise InvalidRequestError(
            f"attention_mask row {row} holds values other than 0 and 1 "
            f"({mask[row].unique().tolist()}); verl's attention_mask is 1 on real tokens and 0 on "
            f"padding"
        )
    m = mask.to(torch.int64)
    prompt, response = m[:, :prompt_width], m[:, prompt_width:]
    holes = (prompt[:, 1:] < prompt[:, :-1]).any(dim=1)
    if bool(holes.any()):
        row = _first_bad_row(holes)
        raise InvalidRequestError(
            f"attention_mask row {row} is not left-padded over the prompt "
            f"({prompt[row].tolist()}): verl left-pads prompts, so the prompt part must be 0s "
            f"then 1s; a hole or a 1 over left padding means the mask disagrees with the padding"
        )
    holes = (response[:, 1:] > response[:, :-1]).any(dim=1)
    if bool(holes.any()):
        row = _first_bad_row(holes)
        raise InvalidRequestError(
            f"attention_mask row {row} is not right-padded over the response "
            f"({response[row].tolist()}): verl right-pads responses, so the response part must "
            f"be 1s then 0s; a hole or a 1 over right padding means the mask disagrees with the "
            f"padding"
        )
    raise AssertionError("unreachable: a mask that is not verl's has a first bad row")


def check_padding(name: str, t: torch.Tensor, keep: torch.Tensor, pad: float, what: str) -> None:
    """Raise unless every position of ``t`` outside ``keep`` (``[B, W]`` bool) holds ``pad``.

    Stripping drops those positions and re-padding writes ``pad`` back, so anything else there
    would not come back: it is a mask that disagrees with the data.
    """
    if bool(((t == pad) | _expand(keep, t)).all()):
        return
    outside = t[~keep]
    if outside.numel() == 0:
        return
    bad = outside != pad
    if outside.ndim > 1:
        bad = bad.flatten(1).any(dim=1)
    if not bool(bad.any()):
        return
    per_row = torch.zeros(keep.shape, dtype=torch.bool)
    per_row[~keep] = bad
    row = _first_bad_row(per_row.any(dim=1))
    col = int(per_row[row].nonzero()[0, 0])
    value = t[row, col]
    shown = value.item() if value.numel() == 1 else value.tolist()
    raise InvalidRequestError(
        f"{name} row {row} holds {shown!r} at position {col}, {what} (attention_mask is 0 there), "
        f"where verl pads with {pad!r}: the masks disagree with the padding"
    )


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """Row offsets ``[B + 1]`` (int64) of rows of these lengths."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def strip(t: torch.Tensor, keep: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` (``[B, W, ...]``) without the positions ``keep`` (``[B, W]``) drops, as a
    jagged nested tensor over one gather for the batch; ``offsets``: of the rows ``keep`` leaves
    (:func:`offsets_of` its row sums)."""
    from tqstream.protocol.columns import jagged

    return jagged(t.masked_select(keep) if t.ndim == 2 else t[keep], offsets)


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` ``[B, W]`` over ``like``'s trailing dims."""
    return mask.reshape(*mask.shape, *[1] * (like.ndim - 2)).expand(like.shape)


def pad_rows(
    values: torch.Tensor,
    offsets: torch.Tensor,
    width: int,
    pad: float,
    *,
    left: bool,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, width, ...]`` from ragged rows (row ``i`` is ``values[offsets[i]:offsets[i+1]]``),
    filled with ``pad``, rows aligned right (``left=True``: left padding) or left. One masked
    scatter (it fills the kept positions in row-major order, which is the rows' order); ``keep``:
    those positions (``[B, width]`` bool) when the caller has them already."""
    offsets = offsets.to(torch.int64)
    lo, hi = int(offsets[0]), int(offsets[-1])
    n = offsets.numel() - 1
    out = torch.full((n, width, *values.shape[1:]), pad, dtype=values.dtype)
    if hi > lo:
        if keep is None:
            lengths = offsets[1:] - offsets[:-1]
            cols = torch.arange(width)[None, :]
            keep = cols >= (width - lengths)[:, None] if left else cols < lengths[:, None]
        out.masked_scatter_(_expand(keep, out), values[lo:hi])
    return out


def keeps(
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    prompt_width: int,
    response_width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens of rows of these lengths (bool ``[B, P]`` and ``[B, R]``): at the right of
    the prompt part, at the left of the response part."""
    prompt = torch.arange(prompt_width)[None, :] >= (prompt_width - prompt_lengths)[:, None]
    response = torch.arange(response_width)[None, :] < response_lengths[:, None]
    return prompt, response
