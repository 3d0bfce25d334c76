"""Hypothesis: per-row versions derived from a per-token versions column equal a brute-force
reading of the tokens (prompt positions -1 ignored; a row without generated tokens takes the
producer's version), for ragged and dense columns, any integer dtype and empty rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqstream.client.versions import row_versions
from tqstream.convert.inputs import columns_from_data
from tqstream.errors import SchemaError

DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
token = st.integers(-3, 100)  # any negative is a prompt position


def expected(rows: list[list[int]], fallback: int | None) -> tuple[list, list]:
    starts, ends = [], []
    for row in rows:
        generated = [v for v in row if v >= 0]
        starts.append(min(generated) if generated else fallback)
        ends.append(max(generated) if generated else fallback)
    return starts, ends


@settings(deadline=None)  # the first call imports tensordict
@given(
    rows=st.lists(st.lists(token, max_size=12), min_size=1, max_size=8),
    dtype=st.sampled_from(DTYPES),
    fallback=st.none() | st.integers(0, 9),
)
def test_ragged_rows_match_brute_force(rows: list[list[int]], dtype: torch.dtype, fallback) -> None:
    _, columns = columns_from_data({"versions": [torch.tensor(r, dtype=dtype) for r in rows]})
    assert row_versions("versions", columns["versions"], fallback) == expected(rows, fallback)


@settings(deadline=None)
@given(
    n=st.integers(1, 6),
    length=st.integers(0, 6),
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    fallback=st.none() | st.integers(0, 9),
)
def test_dense_rows_match_brute_force(
    n: int, length: int, data: st.DataObject, dtype: torch.dtype, fallback
) -> None:
    rows = [data.draw(st.lists(token, min_size=length, max_size=length)) for _ in range(n)]
    t = torch.tensor(rows, dtype=dtype).reshape(n, length)
    _, columns = columns_from_data({"versions": t})
    assert row_versions("versions", columns["versions"], fallback) == expected(rows, fallback)


def test_uint8_versions_are_all_generated_tokens() -> None:
    _, columns = columns_from_data({"versions": [torch.tensor([3, 250], dtype=torch.uint8),
                                                 torch.tensor([], dtype=torch.uint8)]})  # fmt: skip
    assert row_versions("versions", columns["versions"], 7) == ([3, 7], [250, 7])


def test_large_versions_keep_their_exact_value() -> None:
    big = 2**62 + 1  # a float64 reduction would round it
    _, columns = columns_from_data({"versions": [torch.tensor([-1, big, big + 2])]})
    assert row_versions("versions", columns["versions"], 0) == ([big], [big + 2])


def test_a_float_versions_field_is_refused() -> None:
    _, columns = columns_from_data({"versions": [torch.tensor([0.0, 1.0])]})
    with pytest.raises(SchemaError, match="must hold one integer per token"):
        row_versions("versions", columns["versions"], 0)
