"""Rows put as lists of tensors come back from a process cluster exactly as the plain torch
construction of them (``torch.cat`` of the rows, offsets from their lengths): each row copied once
by the client, into the shared-memory segment or the frame that carries it, on every way a put
goes — one exchange or placed by the controller (spread over two units), through /dev/shm (written
with ``write()`` or through the client's own mapping) or over TCP, alone or coalesced with the puts
issued with it. Hypothesis draws every dtype tqstream carries, one row, rows of length 0, trailing
dimensions and strided rows."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tqstream
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol import shm
from tqstream.protocol.columns import DTYPES

ROUTES = {
    "shm-direct": tqstream.ClientConfig(shared_memory_min_bytes=0),
    "shm-placed": tqstream.ClientConfig(shared_memory_min_bytes=0, direct_put_bytes=0),
    "tcp-direct": tqstream.ClientConfig(shared_memory="off"),
    "tcp-placed": tqstream.ClientConfig(shared_memory="off", direct_put_bytes=0),
}
_names = itertools.count()


def sample(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 50
    if dtype.is_complex:
        return torch.complex(t, -t).to(dtype)
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point:
        t = t.abs() if str(dtype).startswith("torch.uint") else t
        return t.to(torch.int64).to(dtype)
    return t.to(dtype)


@st.composite
def ragged(draw: st.DrawFn) -> list[torch.Tensor]:
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    trailing = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1 << 16)))
    if draw(st.booleans()):  # every other value of a longer tensor
        return [sample(dtype, (2 * n, *trailing), gen)[::2] for n in lengths]
    return [sample(dtype, (n, *trailing), gen) for n in lengths]


def bits(t: torch.Tensor) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # strides of its own
    return bytes(flat.view(torch.uint8).numpy())


def assert_holds(
    columns: Any, rows: list[torch.Tensor], ids: torch.Tensor, name: str = "x"
) -> None:
    """The fetched column of ``rows`` is their concatenation and their offsets."""
    col = columns[name]
    values = torch.cat(rows)
    assert col.values.dtype == values.dtype and col.values.shape == values.shape
    assert bits(col.values) == bits(values)
    assert col.offsets.tolist() == [0, *torch.tensor([r.shape[0] for r in rows]).cumsum(0)]
    assert torch.equal(columns["id"].values, ids)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ProcessCluster]:
    with ProcessCluster(2) as c:  # two units: a placed put is spread over both
        yield c


@pytest.fixture(scope="module", params=list(ROUTES))
def route(request: pytest.FixtureRequest, cluster: ProcessCluster) -> Iterator[tuple[str, Any]]:
    client = tqstream.connect(cluster.address, ROUTES[request.param])
    try:
        yield request.param, client
    finally:
        client.close()


def _put_and_read(client: Any, rows: list[torch.Tensor], parts: int) -> None:
    partition = f"ragged-{next(_names)}"
    n = len(rows)
    ids = torch.arange(n, dtype=torch.int64)
    if parts == 1:
        meta = client.put({"x": rows, "id": ids}, partition)
        keys = list(meta.keys)
    else:  # issued together: coalesced into one put of every row (the later ones deferred)
        cuts = [round(i * n / parts) for i in range(parts + 1)]
        pieces = [(rows[a:b], ids[a:b]) for a, b in itertools.pairwise(cuts) if b > a]

        async def together() -> list[Any]:
            puts = [client.async_put({"x": r, "id": i}, partition) for r, i in pieces]
            return list(await asyncio.gather(*puts))

        keys = [k for meta in asyncio.run(together()) for k in meta.keys]
    try:
        batch = client.get_by_keys(partition, keys, ["x", "id"])
        assert batch.columns is not None
        assert_holds(batch.columns, rows, ids)
        got = batch.data["x"]
        for row, want in zip(got.unbind() if got.is_nested else got, rows, strict=True):
            assert bits(row) == bits(want)
    finally:
        client.clear_partition(partition)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=ragged(), mapped=st.booleans(), parts=st.sampled_from([1, 1, 3]))
def test_rows_round_trip_as_their_concatenation(
    route: tuple[str, Any], rows: list[torch.Tensor], mapped: bool, parts: int
) -> None:
    client = route[1]
    saved = shm.MAPPED_WRITE_BYTES
    if mapped:  # the client writes its segments through a mapping it keeps, not write()
        shm.MAPPED_WRITE_BYTES = 0
    try:
        _put_and_read(client, rows, parts)
    finally:
        shm.MAPPED_WRITE_BYTES = saved


@pytest.mark.parametrize("name", list(ROUTES))
def test_many_long_rows_round_trip(cluster: ProcessCluster, name: str) -> None:
    """A batch like a rollout's (a few MB: written staged, or through a mapping), one row longer
    than a staging window; its per-token versions give each row's bounds."""
    gen = torch.Generator().manual_seed(5)
    lengths = [*torch.randint(0, 2048, (300,), generator=gen).tolist(), 300_000]
    rows = [torch.randint(-1, 9, (n,), generator=gen, dtype=torch.int32) for n in lengths]
    client = tqstream.connect(cluster.address, ROUTES[name])
    try:
        partition = f"ragged-{next(_names)}"
        data = {"versions": rows, "id": torch.arange(len(rows))}
        meta = client.put(data, partition, version=3)
        generated = [r[r >= 0] for r in rows]
        assert meta.version_start == [int(g.min()) if len(g) else 3 for g in generated]
        assert meta.version_end == [int(g.max()) if len(g) else 3 for g in generated]
        batch = client.get_by_keys(partition, list(meta.keys), ["versions", "id"])
        assert batch.columns is not None
        assert_holds(batch.columns, rows, torch.arange(len(rows)), "versions")
        client.clear_partition(partition)
    finally:
        client.close()
