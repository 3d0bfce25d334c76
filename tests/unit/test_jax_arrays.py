"""The JAX adapter's pure core: padding to buckets and packing, against the plain construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")

from tqstream.adapters.jax.arrays import (  # noqa: E402
    NP_DTYPES,
    bucket_for,
    check_buckets,
    pack,
    pad_rows,
)
from tqstream.errors import BucketError, SchemaError  # noqa: E402
from tqstream.protocol.columns import DTYPES, Column  # noqa: E402
from tqstream.types import FieldSchema  # noqa: E402

# 32-bit mode has no 64-bit dtypes: those are narrowed or refused (tests/adapters/test_jax.py)
NARROW_SAFE = [d for d in DTYPES if d not in ("int64", "uint64", "float64", "complex128")]


def _column(dtype: str, lengths: list[int], trail: tuple[int, ...], seed: int) -> Column:
    total, size = sum(lengths), NP_DTYPES[dtype].itemsize
    raw = np.random.default_rng(seed).integers(0, 256, total * int(np.prod(trail)) * size)
    if dtype == "bool":
        raw %= 2
    values = (
        torch.tensor(raw.astype(np.uint8)).view(DTYPES[dtype]).reshape(total, *trail)
        if total
        else torch.empty((0, *trail), dtype=DTYPES[dtype])
    )
    offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    return Column(FieldSchema("ragged", dtype, trail), values, offsets)


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bits, as unsigned ints of the item's size (bfloat16, complex64 included)."""
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(NARROW_SAFE),
    lengths=st.lists(st.integers(0, 9), min_size=0, max_size=7),
    trail=st.sampled_from([(), (2,), (3, 2)]),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_padding_equals_the_plain_construction(
    dtype: str, lengths: list[int], trail: tuple[int, ...], extra: int, seed: int
) -> None:
    col = _column(dtype, lengths, trail, seed)
    length = max(lengths, default=0) + extra
    got = np.asarray(pad_rows("f", col, length, 1))
    assert got.shape == (len(lengths), length, *trail) and got.dtype == NP_DTYPES[dtype]
    source = _bits(np.asarray(jax.dlpack.from_dlpack(col.values)))
    expect = np.full(got.shape, _bits(np.array(1, NP_DTYPES[dtype]))[()], dtype=source.dtype)
    start = 0
    for i, n in enumerate(lengths):  # the plain construction: a row at a time
        expect[i, :n] = source[start : start + n]
        start += n
    assert np.array_equal(_bits(got), expect)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(NARROW_SAFE),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    extra=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_packing_keeps_the_values_and_numbers_the_rows(
    dtype: str, lengths: list[int], extra: int, seed: int
) -> None:
    col = _column(dtype, lengths, (), seed)
    total = sum(lengths)
    values, segments = (np.asarray(a) for a in pack("f", col, total + extra, 0))
    source = np.asarray(jax.dlpack.from_dlpack(col.values))
    assert values.dtype == NP_DTYPES[dtype]
    assert np.array_equal(_bits(values[:total]), _bits(source))
    assert not _bits(values[total:]).any()
    expect = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(extra)])
    assert segments.dtype == np.int32 and np.array_equal(segments, expect)


def test_int64_narrowed_only_when_it_fits() -> None:
    col = _column("int64", [2, 3], (), 0)
    fits = Column(col.schema, torch.tensor([1, -2, 3, 2**31 - 1, -(2**31)]), col.offsets)
    got = np.asarray(pad_rows("ids", fits, 4, 0))
    assert got.dtype == np.int32
    assert got.tolist() == [[1, -2, 0, 0], [3, 2**31 - 1, -(2**31), 0]]
    wide = Column(col.schema, torch.tensor([1, 2, 3, 2**31, 5]), col.offsets)
    with pytest.raises(SchemaError, match=r"holds 2147483648, which does not fit int32.*x64"):
        pad_rows("ids", wide, 4, 0)


def test_buckets_are_checked_and_chosen() -> None:
    assert check_buckets("f", [8, 16]) == (8, 16)
    assert bucket_for("f", 9, (8, 16)) == 16
    assert bucket_for("f", 8, (8, 16)) == 8
    assert bucket_for("f", 5, None) == 5
    with pytest.raises(BucketError, match=r"a row of 17 is longer than the largest bucket"):
        bucket_for("f", 17, (8, 16))
    for bad, message in [((), "empty"), ((8, 8), "strictly increasing"), ((0, 4), "positive"),
                         ((4.0,), "positive")]:  # fmt: skip
        with pytest.raises(BucketError, match=message):
            check_buckets("f", bad)  # type: ignore[arg-type]


def test_a_pad_value_the_dtype_cannot_hold_is_refused() -> None:
    col = _column("uint8", [1, 2], (), 0)
    with pytest.raises(SchemaError, match=r"pad value -1 does not fit its dtype uint8"):
        pad_rows("f", col, 4, -1)
