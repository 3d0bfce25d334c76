"""A padded read against the plain construction: every dtype, empty batches, one row, rows of
length 0, trailing shapes, pad values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.convert.tensordict import to_tensordict
from tqstream.errors import SchemaError
from tqstream.protocol.columns import DTYPES, WIRE_NAMES, Column
from tqstream.types import FieldSchema


def _rows(dtype: torch.dtype, lengths: list[int], trail: tuple[int, ...], seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        raw = torch.randint(0, 256, (n * int(torch.tensor(trail).prod()) * dtype.itemsize,),
                            generator=gen, dtype=torch.uint8)  # fmt: skip
        if dtype == torch.bool:
            raw %= 2
        out.append(raw.view(dtype).reshape(n, *trail) if n else torch.empty(0, *trail, dtype=dtype))
    return out


def _column(rows: list, dtype: torch.dtype, trail: tuple[int, ...]) -> Column:
    values = torch.cat(rows) if rows else torch.empty(0, *trail, dtype=dtype)
    lengths = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64)
    return Column(FieldSchema("ragged", WIRE_NAMES[dtype], trail), values, lengths.cumsum(0))


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(list(DTYPES.values())),
    lengths=st.lists(st.integers(0, 7), min_size=0, max_size=6),
    trail=st.sampled_from([(), (3,), (2, 2)]),
    pad=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_padded_equals_the_plain_construction(
    dtype: torch.dtype, lengths: list[int], trail: tuple[int, ...], pad: int, seed: int
) -> None:
    rows = _rows(dtype, lengths, trail, seed)
    td = to_tensordict(len(rows), {"f": _column(rows, dtype, trail)}, padded=True, pad_values=pad)
    got, got_lengths = td["f"], td["f_lengths"]
    longest = max(lengths, default=0)
    expect = torch.full((len(rows), longest, *trail), pad, dtype=dtype)
    for i, r in enumerate(rows):  # a row at a time
        expect[i, : len(r)] = r
    assert got.dtype == dtype and got.shape == expect.shape
    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))  # bits: NaNs, -0.0
    assert got_lengths.tolist() == lengths


def test_a_pad_value_the_dtype_cannot_hold_is_refused() -> None:
    col = _column(_rows(torch.uint8, [1, 2], (), 0), torch.uint8, ())
    with pytest.raises(SchemaError, match=r"pad value -1 does not fit its dtype uint8"):
        to_tensordict(2, {"f": col}, padded=True, pad_values=-1)


def test_a_negative_zero_pad_is_written() -> None:
    col = _column([torch.ones(1), torch.ones(3)], torch.float32, ())
    out = to_tensordict(2, {"f": col}, padded=True, pad_values=-0.0)["f"]
    assert torch.signbit(out[0, 1:]).all()
