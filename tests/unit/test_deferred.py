"""Deferred encoding (``deferred.py``): which inputs a coalescing client defers, and that puts
encoded as one batch at the merge make exactly the put that encoding each in its call makes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.client import coalesce
from tqstream.client.deferred import Deferred, Signatures, encode_batch
from tqstream.client.requests import encode_put
from tqstream.errors import SchemaError
from tqstream.protocol.columns import Column

MAX = 16 << 20  # ClientConfig.direct_put_bytes


def put_args(data: Any, version: int | None = None, versions_field: str | None = "versions"):
    return (data, "p", None, None, None, version, None, versions_field, False, None, None)


def trajectory(lengths: list[int], generated: list[int], reward: float) -> dict[str, Any]:
    """Rows of ``lengths`` tokens, the last ``generated`` of each under versions 3, 4, ..."""
    versions = [
        torch.tensor([-1] * (n - g) + [3 + k % 2 for k in range(g)], dtype=torch.int32)
        for n, g in zip(lengths, generated, strict=True)
    ]
    return {
        "ids": [torch.arange(n) for n in lengths],
        "versions": versions,
        "reward": torch.full((len(lengths),), reward),
        "mask": torch.ones(len(lengths), 2, dtype=torch.bool),
    }


def test_a_known_signature_is_deferred_and_the_first_of_it_learns_it() -> None:
    signatures = Signatures(MAX)
    req, columns = encode_put(*put_args(trajectory([3], [2], 1.0)), signatures)
    assert isinstance(columns, dict) and req.version_start == [3]
    req2, deferred = encode_put(*put_args(trajectory([5], [0], 2.0), version=7), signatures)
    assert isinstance(deferred, Deferred)
    assert req2.schemas == req.schemas and req2.n_rows == 1
    assert req2.version_start is None  # the rows' versions come with the encoding
    again, cols = deferred.encode(req2)
    assert again.version_start == again.version_end == [7]  # no generated token: version=
    assert again.nbytes == req2.nbytes == sum(c.nbytes for c in cols.values())
    # another versions field, a rejecting put, coalescing off: encoded in the call
    other = encode_put(*put_args(trajectory([2], [1], 0.0), versions_field=None), signatures)
    assert isinstance(other[1], dict)
    rejecting = list(put_args(trajectory([2], [1], 0.0)))
    rejecting[8] = True
    assert isinstance(encode_put(*rejecting, signatures)[1], dict)
    assert isinstance(encode_put(*put_args(trajectory([2], [1], 0.0)))[1], dict)


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(2, requires_grad=True),
        torch.zeros(2, dtype=torch.complex64),
        torch.tensor(1.0),  # 0-dim
        [torch.zeros(2), torch.zeros(2, dtype=torch.float64)],  # rows of two dtypes
        [torch.zeros(2), torch.zeros(2, 1)],  # two trailing shapes
        [torch.zeros(2), np.zeros(2)],
        [],
        np.zeros(2),
        torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
        torch.zeros(3),  # three rows where the other field has two
        ["a", "b"],
    ],
    ids=lambda v: type(v).__name__,
)
def test_inputs_a_put_checks_row_by_row_are_never_deferred(value: Any) -> None:
    assert Signatures(MAX).of({"x": [torch.zeros(1), torch.zeros(1)], "y": value}, None) is None


def test_a_put_too_large_to_coalesce_is_encoded_in_its_call() -> None:
    signatures = Signatures(1000)
    encode_put(*put_args({"x": [torch.zeros(10)]}), signatures)
    small = encode_put(*put_args({"x": [torch.zeros(20)]}), signatures)[1]
    assert isinstance(small, Deferred)  # 80 + 16 bytes of offsets
    for rows in ([torch.zeros(300)], [torch.zeros(100)] * 3):  # 1,216 and 1,232 bytes
        assert isinstance(encode_put(*put_args({"x": rows}), signatures)[1], dict)


def test_signatures_are_kept_up_to_a_limit() -> None:
    signatures = Signatures(MAX)
    for i in range(Signatures.LIMIT + 5):
        encode_put(*put_args({f"f{i}": torch.zeros(1)}), signatures)
    assert len(signatures._schemas) == Signatures.LIMIT
    last = {f"f{Signatures.LIMIT + 1}": torch.zeros(1)}
    assert isinstance(encode_put(*put_args(last), signatures)[1], dict)


def test_a_batch_whose_values_break_its_signature_is_refused() -> None:
    req, _ = encode_put(*put_args({"x": torch.zeros(1, 2)}))
    bad = Deferred({"x": torch.zeros(1, 3)}, None)
    with pytest.raises(SchemaError, match="field 'x': dense float32\\[2\\] expected"):
        encode_batch([req], [bad])


puts_st = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3),
        st.one_of(st.none(), st.integers(0, 9)),
        st.booleans(),  # deferred, or encoded in its call
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(puts=puts_st, versions_field=st.sampled_from(["versions", None]))
def test_a_batch_encoded_at_the_merge_is_the_put_of_puts_encoded_in_their_calls(
    puts: list[Any], versions_field: str | None
) -> None:
    signatures = Signatures(MAX)
    encode_put(*put_args(trajectory([1], [1], 0.0), versions_field=versions_field), signatures)
    eager, lazy = [], []
    for i, (rows, version, deferred) in enumerate(puts):
        lengths = [n for n, _ in rows]
        data = trajectory(lengths, [min(g, n) for n, g in rows], float(i))
        args = put_args(data, version, versions_field)
        eager.append(coalesce.Pending(*encode_put(*args), None))
        lazy.append(coalesce.Pending(*encode_put(*args, signatures if deferred else None), None))
    assert [isinstance(p.columns, Deferred) for p in lazy] == [d for _, _, d in puts]
    want_req, want = coalesce.merge(eager)
    got_req, got = coalesce.merge(lazy)
    assert got_req == want_req
    assert got.keys() == want.keys()
    for name, col in want.items():
        assert_same(got[name], col)


def assert_same(a: Column, b: Column) -> None:
    assert a.schema == b.schema
    assert torch.equal(a.values, b.values)
    assert (a.offsets is None) == (b.offsets is None)
    if a.offsets is not None:
        assert torch.equal(a.offsets, b.offsets)
