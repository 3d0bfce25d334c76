"""verl's padded token layout, both ways: per-row lengths from the mask, strip, re-pad.

verl's rollout (``AgentLoopWorker._agent_loop_postprocess``) pads every trajectory to fixed widths:
``prompts`` ``[B, P]`` left-padded, ``responses`` and the response-aligned fields
(``response_mask``, ``rollout_log_probs``) ``[B, R]`` right-padded, and
``attention_mask`` ``[B, P + R]`` 1 exactly on the real tokens. So the mask alone gives each row's
prompt and response length, and a row is its real tokens plus those two lengths. These functions
check that a mask really has that shape (a hole, or 1s over padding, would make the stripped rows
wrong) and move between the two layouts with a few vectorised operations for the whole batch,
never a Python loop over rows.

The selections and placements run on numpy views of the tensors (zero copy): numpy's boolean
indexing is ~4x torch's ``masked_select`` / ``masked_scatter_`` on a CPU (no ``nonzero`` pass
first), and the checks are counts (one comparison and one count a tensor) rather than an
element-wise or-and-reduce. Dtypes numpy lacks (``bfloat16``, the float8 types) are handled as
integers of their width: selecting, placing and comparing with a pad are bitwise.
"""

from __future__ import annotations

import numpy as np
import torch

from tqstream.errors import InvalidRequestError, SchemaError

__all__ = [
    "Real",
    "bits_of",
    "check_padding",
    "keeps",
    "mask_lengths",
    "numpy_view",
    "offsets_of",
    "pad_rows",
    "padding_holds",
    "padding_is_zero",
    "positions",
    "strip",
]

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(dtype: torch.dtype) -> torch.dtype | None:
    """The integer dtype a ``dtype`` tensor is viewed as for numpy (None: numpy has it):
    ``bfloat16``, ``complex32`` and the 1-byte floats (float8) are the ones it lacks."""
    if dtype in (torch.bfloat16, torch.complex32) or (
        dtype.is_floating_point and dtype.itemsize == 1
    ):
        return _AS_INT[dtype.itemsize]
    return None


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array sharing its memory (after a device-to-host copy for an accelerator
    tensor); a dtype numpy lacks is viewed as the signed integer of its width."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    bits = bits_of(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()


def _scalar(value: float, dtype: torch.dtype) -> object:
    """``value`` as an element of :func:`numpy_view` of a ``dtype`` tensor (its bits, for the
    dtypes numpy lacks)."""
    bits = bits_of(dtype)
    return value if bits is None else torch.tensor(value, dtype=dtype).view(bits).item()


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`numpy_view` for a fresh array."""
    t = torch.from_numpy(array)
    return t.view(dtype) if t.dtype != dtype else t


class Real:
    """The real (unpadded) positions of a ``[B, W]`` padded batch: ``keep`` (numpy bool
    ``[B, W]``, possibly a view), ``lengths`` (int64 ``[B]``) and ``offsets`` (int64 ``[B + 1]``)
    of the stripped rows."""

    __slots__ = ("keep", "lengths", "offsets")

    def __init__(self, keep: np.ndarray, lengths: torch.Tensor) -> None:
        self.keep, self.lengths, self.offsets = keep, lengths, offsets_of(lengths)


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def mask_lengths(mask: torch.Tensor, prompt_width: int) -> tuple[Real, Real]:
    """The real tokens of the prompt and the response part of a verl ``attention_mask``.

    The prompt part must be left-padded (0s, then 1s) and the response part right-padded (1s,
    then 0s), with only 0 and 1 in it: verl builds it so, and anything else means the mask and
    the padding disagree, so stripping by it would keep padding or lose tokens.
    """
    if mask.ndim != 2:
        raise SchemaError(
            f"attention_mask must be [batch, prompt_length + response_length], got shape "
            f"{list(mask.shape)}"
        )
    m = numpy_view(mask)
    keep = m if m.dtype == np.bool_ else m != 0
    p_keep, r_keep = keep[:, :prompt_width], keep[:, prompt_width:]
    p_len = np.count_nonzero(p_keep, axis=1).astype(np.int64, copy=False)
    r_len = np.count_nonzero(r_keep, axis=1).astype(np.int64, copy=False)
    # the p_len 1s end the prompt part iff the first of them is p_len from its end; the r_len 1s
    # start the response part iff its first 0 is at r_len
    p_first = np.argmax(p_keep, axis=1)
    r_first_zero = np.argmax(~r_keep, axis=1)
    r_width = mask.shape[1] - prompt_width
    binary = m.dtype == np.bool_ or np.count_nonzero(m == 1) == np.count_nonzero(keep)
    if (
        binary
        and bool(np.all((p_first == prompt_width - p_len) | (p_len == 0)))
        and bool(np.all((r_first_zero == r_len) | (r_len == r_width)))
    ):
        return Real(p_keep, torch.from_numpy(p_len)), Real(r_keep, torch.from_numpy(r_len))
    _raise_bad_mask(mask, prompt_width)
    raise AssertionError("unreachable: a mask that is not verl's has a first bad row")


def _raise_bad_mask(mask: torch.Tensor, prompt_width: int) -> None:
    """Raise the error naming the first row where ``mask`` is not verl's."""
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


def strip(t: torch.Tensor, real: Real) -> torch.Tensor:
    """The real positions of ``t`` (``[B, W, ...]``) in row-major order, ``[sum L_i, ...]``: the
    values of the ragged rows whose offsets are ``real.offsets``."""
    return _tensor(numpy_view(t)[real.keep], t.dtype)


def check_padding(
    name: str, t: torch.Tensor, stripped: torch.Tensor, real: Real, pad: float, what: str
) -> None:
    """Raise unless every position of ``t`` outside ``real`` holds ``pad`` (``stripped``: what
    :func:`strip` kept of ``t``).

    Stripping drops those positions and re-padding writes ``pad`` back, so anything else there
    would not come back: it is a mask that disagrees with the data. Checked by counting: the
    values other than ``pad`` in ``t`` are all among the kept ones.
    """
    if padding_holds(t, stripped, pad):
        return
    bad = numpy_view(t) != _scalar(pad, t.dtype)
    if bad.ndim > 2:
        bad = bad.reshape(*bad.shape[:2], -1).any(axis=2)
    row, col = (int(i) for i in np.argwhere(bad & ~real.keep)[0])
    value = t[row, col]
    shown = value.item() if value.numel() == 1 else value.tolist()
    raise InvalidRequestError(
        f"{name} row {row} holds {shown!r} at position {col}, {what} (attention_mask is 0 there), "
        f"where verl pads with {pad!r}: the masks disagree with the padding"
    )


def padding_holds(t: torch.Tensor, stripped: torch.Tensor, pad: float) -> bool:
    """Whether every position of ``t`` that :func:`strip` left out of ``stripped`` holds ``pad``
    (by value: ``-0.0`` passes for 0): the values other than ``pad`` in ``t`` are as many as in
    ``stripped``."""
    value = _scalar(pad, t.dtype)
    return _as_many(numpy_view(t) != value, numpy_view(stripped) != value)


def padding_is_zero(t: torch.Tensor, stripped: torch.Tensor) -> bool:
    """:func:`padding_holds` with 0, bit for bit: a ``-0.0`` does not pass."""
    return _as_many(_zero_bits(numpy_view(t)) != 0, _zero_bits(numpy_view(stripped)) != 0)


def _as_many(whole: np.ndarray, kept: np.ndarray) -> bool:
    return bool(np.count_nonzero(whole) == np.count_nonzero(kept))


def _zero_bits(a: np.ndarray) -> np.ndarray:
    """``a`` with floats viewed as integers of their width: 0 exactly where all bits are 0."""
    if a.dtype.kind == "f":
        return a.view(f"i{a.dtype.itemsize}")
    if a.dtype.kind == "c":  # two floats an element: the last axis doubles
        return np.ascontiguousarray(a).view(f"i{a.dtype.itemsize // 2}")
    return a


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """Row offsets ``[B + 1]`` (int64) of rows of these lengths."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def pad_rows(
    values: torch.Tensor,
    offsets: torch.Tensor,
    width: int,
    pad: float,
    *,
    left: bool,
    keep: np.ndarray | None = None,
) -> torch.Tensor:
    """``[B, width, ...]`` from ragged rows (row ``i`` is ``values[offsets[i]:offsets[i+1]]``),
    filled with ``pad``, rows aligned right (``left=True``: left padding) or left. One boolean
    placement (it fills the kept positions in row-major order, which is the rows' order); ``keep``:
    those positions (``[B, width]`` bool, :func:`keeps`) when the caller has them already."""
    offsets = offsets.to(torch.int64)
    lo, hi = int(offsets[0]), int(offsets[-1])
    n = offsets.numel() - 1
    out = torch.empty((n, width, *values.shape[1:]), dtype=values.dtype)
    placed = numpy_view(out)
    placed.fill(_scalar(pad, values.dtype))
    if hi > lo:
        if keep is None:
            keep = keeps(offsets[1:] - offsets[:-1], width, left=left)
        placed[keep] = numpy_view(values[lo:hi])
    return out


def keeps(lengths: torch.Tensor, width: int, *, left: bool) -> np.ndarray:
    """The real positions (numpy bool ``[B, width]``) of rows of these lengths padded to
    ``width``: at the right (``left=True``: left padding, as a prompt) or at the left."""
    cols, n = np.arange(width), lengths.numpy()[:, None]
    return cols >= width - n if left else cols < n


def positions(p_len: torch.Tensor, r_len: torch.Tensor, p_width: int, r_width: int) -> np.ndarray:
    """The ``position_ids`` (int64 ``[B, P + R]``) verl computes from the ``attention_mask`` of
    rows of these lengths (``compute_position_id_with_mask``: the mask's running sum less one,
    at least 0): 0 over the left padding, then 0, 1, ... over the real tokens, which are one run,
    then the last position again over the right padding."""
    p, r = p_len.to(torch.int64), r_len.to(torch.int64)
    out = torch.arange(p_width + r_width).unsqueeze(0) - (p_width - p).unsqueeze(1)
    out.clamp_(min=0)  # in place: torch's kernels take half numpy's time on this [B, P + R]
    torch.minimum(out, (p + r - 1).clamp_(min=0).unsqueeze(1), out=out)
    return out.numpy()
