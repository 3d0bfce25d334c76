"""Hypothesis: the weight-sync byte stream. Any state dict, sent as the ranges of its plan for any
bucket size (large tensors from their own memory, small ones packed range by range), unpacks to
bit-identical tensors; the ranges are ordered, disjoint, cover every tensor's bytes and stay within
the bucket size unless they are one tensor; every tensor starts aligned; metadata round-trips and
fingerprints tell different metadata apart."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.errors import WeightMismatchError
from tqstream.reference.weightsync.layout import ALIGN, WeightMeta, pack, plan, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool,
          torch.float64, torch.complex64]  # fmt: skip


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    n = draw(st.integers(0, 6))
    out = {}
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,),
                            generator=gen, dtype=torch.uint8)  # fmt: skip
        t = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
        out[f"layer{i}.w"] = t
    return out


@settings(deadline=None, max_examples=200)
@given(
    weights=state_dicts(),
    bucket_bytes=st.integers(1, 300),
    direct_bytes=st.none() | st.integers(1, 300),
)
def test_stream_round_trip_through_the_plan(
    weights: dict, bucket_bytes: int, direct_bytes: int | None
) -> None:
    meta = WeightMeta.of(weights)
    ranges = plan(meta, bucket_bytes, direct_bytes)
    direct = bucket_bytes if direct_bytes is None else min(bucket_bytes, direct_bytes)
    covered = set()
    for k, (a, b, i) in enumerate(ranges):
        assert a < b and (k + 1 == len(ranges) or b <= ranges[k + 1][0])
        if i >= 0:
            assert (a, b) == (meta.offsets[i], meta.offsets[i] + meta.nbytes(i))
            assert meta.nbytes(i) >= direct
        else:
            assert b - a <= bucket_bytes
            assert all(meta.nbytes(j) < direct for j, at in enumerate(meta.offsets) if a <= at < b)
        covered.update(range(a, b))
    for i, at in enumerate(meta.offsets):
        assert set(range(at, at + meta.nbytes(i))) <= covered
    received = torch.zeros(meta.total, dtype=torch.uint8)
    for a, b, i in ranges:  # what the sender broadcasts, into the receiver's stream
        if i >= 0:
            t = weights[meta.names[i]]
            received[a:b] = t.reshape(-1).view(torch.uint8)
        else:
            bucket = torch.zeros(b - a, dtype=torch.uint8)
            pack(meta, weights, bucket, a, b)
            received[a:b] = bucket
    got = unpack(meta, received)
    assert list(got) == list(weights)
    for name, t in weights.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        if t.numel():
            assert torch.equal(got[name].reshape(-1).view(torch.uint8),
                               t.reshape(-1).view(torch.uint8))  # fmt: skip
    assert all(at % ALIGN == 0 for at in meta.offsets)
    assert WeightMeta.decode(meta.encode()) == meta


@given(a=state_dicts(), b=state_dicts())
def test_fingerprints_tell_metadata_apart(a: dict, b: dict) -> None:
    ma, mb = WeightMeta.of(a), WeightMeta.of(b)
    assert (ma.fingerprint == mb.fingerprint) == (ma == mb)


def test_difference_names_what_differs() -> None:
    mine = WeightMeta(("a", "b", "c"), ("float32", "float32", "int64"), ((2,), (3, 4), (1,)))
    sent = WeightMeta(("a", "b", "d"), ("float32", "bfloat16", "int64"), ((2,), (3, 4), (1,)))
    assert mine.difference(sent) == (
        "missing from the sent weights: c; not expected: d; "
        "expected vs sent: b: float32[3, 4] vs bfloat16[3, 4]"
    )
    assert mine.difference(mine) == ""


def test_bad_metadata_is_refused() -> None:
    with pytest.raises(WeightMismatchError, match="2 names, 1 dtypes and 2 shapes"):
        WeightMeta(("a", "b"), ("float32",), ((1,), (2,)))
    with pytest.raises(WeightMismatchError, match="names a weight twice"):
        WeightMeta(("a", "a"), ("float32", "float32"), ((1,), (2,)))
    with pytest.raises(WeightMismatchError, match="cannot be synced"):
        WeightMeta.of({"x": torch.zeros(2, dtype=torch.uint16)})


def test_a_plan_needs_a_positive_bucket_size() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        plan(WeightMeta.of({"a": torch.zeros(2)}), 0)
