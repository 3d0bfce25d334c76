"""The JAX adapter against a real embedded cluster, trainer processes over 8 CPU devices and
``jax.distributed``, and a trainer SIGKILLed mid-run and resumed from its checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("ml_dtypes")

import jax
import jax.numpy as jnp
import ml_dtypes
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tqstream
from tqstream import Client, StalenessPolicy
from tqstream.adapters.jax import ExperienceIterator, ExperienceWriter, JaxBatch

HERE = Path(__file__).parent
DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
WIDE = {"int64": "int32", "uint64": "uint32"}  # what 32-bit mode narrows them to
NO_32_BIT = ("float64", "complex128")  # refused in 32-bit mode
LENGTHS = (1, 4, 2)  # the ragged rows of every put
WORKER_ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    """One embedded controller + storage unit for the module (each test has its partition)."""
    owner = tqstream.init(storage_units=1)
    yield owner
    owner.close()


@contextlib.contextmanager
def x64(enabled: bool) -> Iterator[None]:
    """JAX's 64-bit mode on or off for the block (process-global config, restored after it)."""
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", enabled)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def task_of(client: Client, partition: str, task: str = "actor") -> Any:
    return client.stats(partition).partitions[partition].tasks[task]


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def sample(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns of ``name`` (NaN payloads, infinities, negative zeros included)."""
    dt = np_dtype(name)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def fitting(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """int64/uint64 values that fit the 32-bit type, the extremes included."""
    info = np.iinfo(WIDE[name])
    out = rng.integers(info.min, info.max, shape, endpoint=True, dtype=np.int64)
    out.flat[0], out.flat[-1] = info.min, info.max
    return out.astype(name)


def as_torch(a: np.ndarray) -> torch.Tensor:
    """A torch tensor of ``a``'s bytes and dtype (what a torch producer puts)."""
    name = "bfloat16" if a.dtype == ml_dtypes.bfloat16 else a.dtype.name
    flat = torch.frombuffer(bytearray(a.tobytes()), dtype=getattr(torch, name))
    return flat.reshape(a.shape)


def put_three_ways(
    client: Client, partition: str, make: Callable[[tuple[int, ...]], np.ndarray], jax_too: bool
) -> dict[str, tuple[np.ndarray, list[np.ndarray]]]:
    """Three rows through each producer path: ExperienceWriter with numpy arrays, with jax
    arrays (``jax_too``), and the plain client's torch put. Each row has a dense ``d`` [2] and a
    ragged ``g`` [L, 3]. Returns key -> (d, g) as put."""
    put: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {}
    writer = ExperienceWriter(client, partition=partition)
    paths = ["np", "jax", "torch"] if jax_too else ["np", "torch"]
    for path in paths:
        d = make((3, 2))
        g = [make((n, 3)) for n in LENGTHS]
        keys = [f"{path}-{i}" for i in range(3)]
        if path == "np":
            writer.put_experience({"d": d, "g": g}, current_version=0, keys=keys)
        elif path == "jax":
            arrays = {"d": jax.device_put(d), "g": [jax.device_put(r) for r in g]}
            assert arrays["d"].dtype == d.dtype  # a jax.Array of the dtype under test
            writer.put_experience(arrays, current_version=0, keys=keys)
        else:
            client.put({"d": as_torch(d), "g": [as_torch(r) for r in g]}, partition, keys=keys)
        put.update({k: (d[i], g[i]) for i, k in enumerate(keys)})
    return put


def read_all(client: Client, partition: str, n: int) -> JaxBatch:
    it = ExperienceIterator(client, ["d", "g"], n, partition=partition, ack="manual")
    return it.get_experience()


def bytes_of(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def assert_rows_bit_exact(
    batch: JaxBatch, put: dict[str, tuple[np.ndarray, list[np.ndarray]]], dtype: np.dtype[Any]
) -> None:
    assert batch.meta is not None and sorted(batch.meta.keys) == sorted(put)
    d, g, lengths = np.asarray(batch["d"]), np.asarray(batch["g"]), np.asarray(batch["g_lengths"])
    assert d.dtype == dtype and g.dtype == dtype
    assert d.shape == (len(put), 2) and g.shape == (len(put), max(LENGTHS), 3)
    for i, key in enumerate(batch.meta.keys):
        want_d, want_g = put[key]
        assert lengths[i] == want_g.shape[0]
        np.testing.assert_array_equal(bytes_of(d[i]), bytes_of(want_d))
        np.testing.assert_array_equal(bytes_of(g[i, : lengths[i]]), bytes_of(want_g))
        assert not bytes_of(g[i, lengths[i] :]).any()  # padded with 0


# --- dtypes ---
@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_round_trips_bit_exact_in_x64_mode(
    client: Client, partition: str, name: str
) -> None:
    rng = np.random.default_rng(DTYPES.index(name))
    with x64(True):
        put = put_three_ways(client, partition, lambda s: sample(name, s, rng), jax_too=True)
        batch = read_all(client, partition, len(put))
        assert_rows_bit_exact(batch, put, np_dtype(name))


@pytest.mark.parametrize("name", [n for n in DTYPES if n not in NO_32_BIT])
def test_dtypes_in_32_bit_mode(client: Client, partition: str, name: str) -> None:
    """32-bit types as they are; int64/uint64 whose values fit come back as int32/uint32."""
    rng = np.random.default_rng(100 + DTYPES.index(name))
    wide = name in WIDE
    with x64(False):
        make = (lambda s: fitting(name, s, rng)) if wide else (lambda s: sample(name, s, rng))
        put = put_three_ways(client, partition, make, jax_too=not wide)
        batch = read_all(client, partition, len(put))
        if not wide:
            assert_rows_bit_exact(batch, put, np_dtype(name))
            return
        assert batch.meta is not None
        d, g = np.asarray(batch["d"]), np.asarray(batch["g"])
        assert d.dtype == g.dtype == np.dtype(WIDE[name])
        for i, key in enumerate(batch.meta.keys):
            want_d, want_g = put[key]
            np.testing.assert_array_equal(d[i], want_d.astype(WIDE[name]))
            np.testing.assert_array_equal(d[i].astype(name), want_d)  # exact, not wrapped
            np.testing.assert_array_equal(g[i, : want_g.shape[0]].astype(name), want_g)


@pytest.mark.parametrize("name", NO_32_BIT)
def test_64_bit_floats_are_refused_in_32_bit_mode(
    client: Client, partition: str, name: str
) -> None:
    rng = np.random.default_rng(200 + DTYPES.index(name))
    put = put_three_ways(client, partition, lambda s: sample(name, s, rng), jax_too=False)
    it = ExperienceIterator(client, ["d", "g"], len(put), partition=partition, ack="manual")
    rounded = "float32" if name == "float64" else "complex64"
    with x64(False), pytest.raises(tqstream.SchemaError) as e:
        it.get_experience()
    assert str(e.value) == (
        f"field 'd' is {name}, which JAX's default 32-bit mode does not have (it would round it "
        f'to {rounded}); enable 64-bit types with jax.config.update("jax_enable_x64", True) '
        f"before reading, or store the field as {rounded}"
    )
    assert task_of(client, partition).leased == 0  # the lease went back
    with x64(True):  # and the same rows are read, exactly, once 64-bit types are on
        assert_rows_bit_exact(it.get_experience(), put, np_dtype(name))


@pytest.mark.parametrize(("name", "bad"), [("int64", -(2**40) - 3), ("uint64", 2**32)])
def test_64_bit_values_that_do_not_fit_32_bits_are_refused(
    client: Client, partition: str, name: str, bad: int
) -> None:
    rows = [np.array([1, bad, 2], dtype=name), np.array([3], dtype=name)]
    ExperienceWriter(client, partition=partition).put_experience(
        {"g": rows, "d": np.array([5, 6], dtype=name)}, current_version=0
    )
    target = WIDE[name]
    it = ExperienceIterator(client, ["g"], 2, partition=partition)
    with x64(False), pytest.raises(tqstream.SchemaError) as e:
        next(it)
    assert str(e.value) == (
        f"field 'g' holds {bad}, which does not fit {target}: JAX's default 32-bit mode would "
        f'wrap it; enable 64-bit types with jax.config.update("jax_enable_x64", True) before '
        f"reading"
    )
    assert task_of(client, partition).leased == 0
    with x64(True):  # another reader, in 64-bit mode, reads the rows given back
        other = ExperienceIterator(client, ["g", "d"], 2, partition=partition)
        batch = next(other)
        assert batch["g"].dtype == np.dtype(name)
        assert np.asarray(batch["g"]).tolist() == [[1, bad, 2], [3, 0, 0]]
        assert np.asarray(batch["d"]).tolist() == [5, 6]


def test_bfloat16_from_ml_dtypes_and_jnp(client: Client, partition: str) -> None:
    values = [0.5, -2.0, 3.140625, float("inf")]
    writer = ExperienceWriter(client, partition=partition)
    writer.put_experience(
        {"h": [np.array(values, dtype=ml_dtypes.bfloat16)], "s": np.array([1.5], jnp.bfloat16)},
        current_version=0,
    )
    writer.put_experience(
        {"h": [jnp.array(values, dtype=jnp.bfloat16)], "s": jnp.array([1.5], jnp.bfloat16)},
        current_version=0,
    )
    batch = next(ExperienceIterator(client, ["h", "s"], 2, partition=partition))
    assert batch["h"].dtype == jnp.bfloat16 and batch["s"].dtype == jnp.bfloat16
    assert np.asarray(batch["h"], dtype=np.float32).tolist() == [values, values]
    assert np.asarray(batch["s"], dtype=np.float32).tolist() == [1.5, 1.5]


# --- buckets ---
def put_rows(client: Client, partition: str, lengths: list[int], **extra: Any) -> list[str]:
    """A row of ``ids`` (row i: i*100, i*100+1, ...), per-token ``versions`` (-1 on the first,
    prompt, token) and a ``mask`` per length, one put per row; returns the keys."""
    writer = ExperienceWriter(client, partition=partition)
    keys = []
    for i, n in enumerate(lengths):
        versions = np.full(n, 3, dtype=np.int32)
        versions[0] = -1
        data = {
            "ids": [np.arange(i * 100, i * 100 + n, dtype=np.int32)],
            "versions": [versions],
            "mask": [np.ones(n, dtype=np.bool_)],
            **{k: v[i : i + 1] for k, v in extra.items()},  # a dense [1] array each
        }
        keys += writer.put_experience(data, current_version=3).keys
    return keys


def ids_rows(batch: JaxBatch) -> list[list[int]]:
    ids, lengths = np.asarray(batch["ids"]), np.asarray(batch["ids_lengths"])
    return [ids[i, :n].tolist() for i, n in enumerate(lengths)]


def test_ragged_fields_pad_to_the_smallest_bucket_that_fits(client: Client, partition: str) -> None:
    put_rows(client, partition, [1, 3, 5])
    it = ExperienceIterator(
        client, ["ids", "versions", "mask"], 3, partition=partition,
        buckets={"ids": (4, 8, 16), "versions": (6, 7)}, pad_values={"ids": 7, "versions": -1},
    )  # fmt: skip
    batch = next(it)
    assert batch["ids"].shape == (3, 8)  # longest 5: the bucket 8
    assert np.asarray(batch["ids"]).tolist() == [
        [0, 7, 7, 7, 7, 7, 7, 7],
        [100, 101, 102, 7, 7, 7, 7, 7],
        [200, 201, 202, 203, 204, 7, 7, 7],
    ]
    assert np.asarray(batch["ids_lengths"]).tolist() == [1, 3, 5]
    assert batch["ids_lengths"].dtype == jnp.int32
    assert np.asarray(batch["versions"]).tolist() == [
        [-1, -1, -1, -1, -1, -1],
        [-1, 3, 3, -1, -1, -1],
        [-1, 3, 3, 3, 3, -1],
    ]
    assert batch["mask"].shape == (3, 5)  # not in the buckets: padded to its longest row
    assert np.asarray(batch["mask"]).sum(axis=1).tolist() == [1, 3, 5]
    assert np.asarray(batch["mask_lengths"]).tolist() == [1, 3, 5]


def test_one_bucket_sequence_for_every_ragged_field(client: Client, partition: str) -> None:
    put_rows(client, partition, [1, 2, 5, 3])
    it = ExperienceIterator(
        client, ["ids", "versions"], 2, partition=partition, buckets=(2, 4, 8), pad_values=-1
    )
    first, second = next(it), next(it)
    assert first["ids"].shape == first["versions"].shape == (2, 2)  # rows of 1 and 2
    assert ids_rows(first) == [[0], [100, 101]]
    assert np.asarray(first["ids"])[0].tolist() == [0, -1]
    assert second["ids"].shape == second["versions"].shape == (2, 8)  # rows of 5 and 3
    assert ids_rows(second) == [[200, 201, 202, 203, 204], [300, 301, 302]]
    assert np.asarray(second["versions"])[1].tolist() == [-1, 3, 3, -1, -1, -1, -1, -1]


def test_a_row_longer_than_every_bucket_is_refused_and_given_back(
    client: Client, partition: str
) -> None:
    put_rows(client, partition, [3, 9])
    it = ExperienceIterator(client, ["ids"], 2, partition=partition, buckets=(4, 8))
    with pytest.raises(tqstream.BucketError) as e:
        next(it)
    assert str(e.value) == (
        "field 'ids': a row of 9 is longer than the largest bucket (buckets: (4, 8)); add a "
        "larger bucket, or cap the rollout's length at 8"
    )
    assert e.value.details["length"] == 9 and e.value.details["buckets"] == [4, 8]
    assert task_of(client, partition).leased == 0  # nothing stays leased
    bigger = ExperienceIterator(client, ["ids"], 2, partition=partition, buckets=(4, 16))
    batch = next(bigger)
    assert batch["ids"].shape == (2, 16)
    assert ids_rows(batch) == [[0, 1, 2], [100 + i for i in range(9)]]


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ((), "field '*': buckets are empty; give the lengths a ragged field may be padded to, "
             "increasing, e.g. (128, 256, 512)"),
        ((8, 4), "field '*': buckets must be strictly increasing, got (8, 4)"),
        ((4, 4), "field '*': buckets must be strictly increasing, got (4, 4)"),
        ((0, 4), "field '*': bucket 0 is not a positive int (buckets: (0, 4))"),
        ((-2,), "field '*': bucket -2 is not a positive int (buckets: (-2,))"),
        ((2.5,), "field '*': bucket 2.5 is not a positive int (buckets: (2.5,))"),
        ({"ids": ()}, "field 'ids': buckets are empty; give the lengths a ragged field may be "
                      "padded to, increasing, e.g. (128, 256, 512)"),
        ({"ids": (16, 8)}, "field 'ids': buckets must be strictly increasing, got (16, 8)"),
        ({"tokens": (8,)}, "buckets name fields not read: ['tokens'] (fields: ['ids'])"),
    ],
)  # fmt: skip
def test_bad_buckets_are_refused_at_construction(
    client: Client, partition: str, buckets: Any, message: str
) -> None:
    with pytest.raises(tqstream.BucketError) as e:
        ExperienceIterator(client, ["ids"], 2, partition=partition, buckets=buckets)
    assert str(e.value) == message


@pytest.mark.parametrize("lengths", [[1, 3], [4, 4]], ids=["padded", "rows-fill-the-bucket"])
def test_a_pad_value_the_dtype_cannot_hold_is_refused(
    client: Client, partition: str, lengths: list[int]
) -> None:
    """Refused whatever the rows' lengths, not only in a batch that happens to need padding."""
    rows = [np.full(n, 200, dtype=np.uint8) for n in lengths]
    ExperienceWriter(client, partition=partition).put_experience({"u": rows}, current_version=0)
    it = ExperienceIterator(
        client, ["u"], 2, partition=partition, buckets=(4,), pad_values={"u": -1}
    )
    with pytest.raises(tqstream.SchemaError) as e:
        next(it)
    assert str(e.value) == (
        "field 'u': pad value -1 does not fit its dtype uint8; pass a representable value in "
        "pad_values"
    )
    assert task_of(client, partition).leased == 0
    fixed = ExperienceIterator(client, ["u"], 2, partition=partition, pad_values={"u": 255})
    longest = max(lengths)
    assert np.asarray(next(fixed)["u"]).tolist() == [[200] * n + [255] * (longest - n)
                                                     for n in lengths]  # fmt: skip


# --- packed ---
def test_packed_rows_with_segment_ids(client: Client, partition: str) -> None:
    put_rows(client, partition, [2, 3, 1])
    it = ExperienceIterator(
        client, ["ids", "mask"], 3, partition=partition, packed=["ids"], buckets={"ids": (4, 8)},
        pad_values={"ids": -5},
    )  # fmt: skip
    batch = next(it)
    assert batch["ids"].shape == (8,)  # 6 tokens: the bucket 8
    assert np.asarray(batch["ids"]).tolist() == [0, 1, 100, 101, 102, 200, -5, -5]
    assert np.asarray(batch["ids_segment_ids"]).tolist() == [1, 1, 2, 2, 2, 3, 0, 0]
    assert np.asarray(batch["ids_lengths"]).tolist() == [2, 3, 1]
    assert batch["mask"].shape == (3, 3)  # not packed: padded
    assert "mask_segment_ids" not in batch


def test_packed_is_refused_with_a_sharding(client: Client, partition: str) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    with pytest.raises(tqstream.InvalidRequestError) as e:
        ExperienceIterator(client, ["ids"], 2, partition=partition, packed=["ids"],
                           sharding=sharding)  # fmt: skip
    assert str(e.value) == (
        "packed fields have no batch axis to shard; with a sharding read them padded to buckets "
        "(or pack them per process, without a sharding)"
    )
    with pytest.raises(tqstream.InvalidRequestError, match=r"^packed names fields not read: "):
        ExperienceIterator(client, ["ids"], 2, partition=partition, packed=["mask"])


# --- groups and versions ---
def test_whole_groups_are_contiguous_and_numbered(client: Client, partition: str) -> None:
    writer = ExperienceWriter(client, partition=partition)
    for i in range(6):  # the samples of prompts a, b, c arrive interleaved, one put each
        group = "abc"[i % 3]
        writer.put_experience(
            {"x": np.array([i], dtype=np.int32)}, current_version=0, group=group, group_size=2
        )
    it = ExperienceIterator(client, ["x"], 4, partition=partition, whole_groups=True)
    batch = next(it)
    assert batch.meta is not None
    groups = batch.meta.groups
    assert sorted(Counter(groups).values()) == [2, 2]  # two whole groups
    assert groups[0] == groups[1] and groups[2] == groups[3] and groups[0] != groups[2]
    assert np.asarray(batch["group_ids"]).tolist() == [0, 0, 1, 1]
    xs = np.asarray(batch["x"]).tolist()
    assert {x % 3 for x in xs[:2]} == {"abc".index(groups[0])}
    assert {x % 3 for x in xs[2:]} == {"abc".index(groups[2])}


def test_row_versions(client: Client, partition: str) -> None:
    writer = ExperienceWriter(client, partition=partition)
    writer.put_experience(
        {"ids": [np.arange(4, dtype=np.int32)], "versions": [np.array([-1, -1, 3, 4], np.int32)]},
        current_version=4,
    )
    writer.put_experience({"ids": [np.arange(2, dtype=np.int32)]}, current_version=7)
    batch = next(ExperienceIterator(client, ["ids"], 2, partition=partition, row_versions=True))
    assert np.asarray(batch["version_start"]).tolist() == [3, 7]
    assert np.asarray(batch["version_end"]).tolist() == [4, 7]
    assert batch["version_start"].dtype == jnp.int32


def test_token_window_gives_a_fresh_mask_padded_like_versions(
    client: Client, partition: str
) -> None:
    writer = ExperienceWriter(client, partition=partition)
    rows = {
        "a": [-1, -1, 3, 4, 5],  # 3 is outside the window [4, 5]
        "b": [-1, 5, 5],
        "old": [-1, 2, 2],  # every generated token outside: not read
    }
    for key, versions in rows.items():
        writer.put_experience(
            {"ids": [np.arange(len(versions), dtype=np.int32)],
             "versions": [np.array(versions, dtype=np.int32)]},
            current_version=max(versions), keys=[key],
        )  # fmt: skip
    it = ExperienceIterator(
        client, ["ids", "versions"], 2, partition=partition, version_fn=lambda: 5,
        staleness=StalenessPolicy(max_staleness=1, measure="token"), buckets={"versions": (8,)},
        pad_values={"versions": -1}, ack="manual",
    )  # fmt: skip
    batch = next(it)
    assert batch.meta is not None and batch.meta.keys == ["a", "b"]
    assert batch["fresh_mask"].shape == batch["versions"].shape == (2, 8)
    assert batch["fresh_mask"].dtype == jnp.bool_
    assert np.asarray(batch["versions"]).tolist() == [
        [-1, -1, 3, 4, 5, -1, -1, -1],
        [-1, 5, 5, -1, -1, -1, -1, -1],
    ]
    f, t = False, True
    assert np.asarray(batch["fresh_mask"]).tolist() == [
        [f, f, f, t, t, f, f, f],
        [f, t, t, f, f, f, f, f],
    ]
    assert batch["ids"].shape == (2, 5)  # not in the buckets: its longest row
    it.ack(batch)
    assert task_of(client, partition).tokens_masked == 1  # the token of version 3


def test_head_window_drops_stale_rows(client: Client, partition: str) -> None:
    writer = ExperienceWriter(client, partition=partition)
    for v in (0, 1, 2, 3):
        writer.put_experience({"x": np.array([v], dtype=np.int32)}, current_version=v)
    it = ExperienceIterator(
        client, ["x"], 2, partition=partition, version_fn=lambda: 3,
        staleness=StalenessPolicy(max_staleness=1, on_stale="drop"),
    )  # fmt: skip
    assert np.asarray(next(it)["x"]).tolist() == [2, 3]
    stats = client.stats(partition).partitions[partition]
    assert stats.stale_dropped == 2 and stats.tasks["actor"].leased == 2


# --- acks, jit, prefetch, timeouts ---
def put_xs(client: Client, partition: str, n: int, start: int = 0) -> None:
    ExperienceWriter(client, partition=partition).put_experience(
        {"x": np.arange(start, start + n, dtype=np.int32)}, current_version=0
    )


def test_ack_next_acks_a_batch_when_the_next_is_asked_for(client: Client, partition: str) -> None:
    put_xs(client, partition, 6)
    it = ExperienceIterator(client, ["x"], 2, partition=partition)
    assert np.asarray(next(it)["x"]).tolist() == [0, 1]
    task = task_of(client, partition)
    assert (task.leased, task.acked) == (2, 0)  # held while "training"
    assert np.asarray(next(it)["x"]).tolist() == [2, 3]
    task = task_of(client, partition)
    assert (task.leased, task.acked) == (2, 2)


def test_ack_manual(client: Client, partition: str) -> None:
    put_xs(client, partition, 4)
    it = ExperienceIterator(client, ["x"], 2, partition=partition, ack="manual")
    first, second = next(it), next(it)
    assert (task_of(client, partition).leased, first.rows) == (4, 2)
    assert it.ack(first) == 2
    assert first.meta is not None and it.ack(first.meta) == 0  # twice is harmless
    task = task_of(client, partition)
    assert (task.leased, task.acked) == (2, 2)
    assert it.release(second) == 2
    assert task_of(client, partition).available == 2


def test_jit_takes_a_batch_and_compiles_once_per_bucket(client: Client, partition: str) -> None:
    put_rows(client, partition, [2, 3, 7, 1, 8, 6], reward=np.arange(6, dtype=np.float32))
    it = ExperienceIterator(
        client, ["ids", "reward"], 2, partition=partition, buckets=(4, 8), ack="manual"
    )
    traces: list[tuple[int, ...]] = []

    @jax.jit
    def step(batch: JaxBatch) -> tuple[jax.Array, JaxBatch]:
        traces.append(tuple(batch["ids"].shape))  # runs only when tracing
        return batch["ids"].sum() + batch["reward"].sum(), batch

    totals, shapes = [], []
    for _ in range(3):
        batch = next(it)
        total, rebuilt = step(batch)
        totals.append(int(total))
        shapes.append(tuple(batch["ids"].shape))
        assert rebuilt.meta is None and rebuilt.objects == {}  # rebuilt from the leaves
        with pytest.raises(tqstream.InvalidRequestError) as e:
            it.ack(rebuilt)
        assert str(e.value) == (
            "this batch carries no tqstream lease: pass a batch exactly as ExperienceIterator "
            "yielded it (one rebuilt inside jax.jit has none), or its .meta"
        )
        it.ack(batch)
    assert shapes == [(2, 4), (2, 8), (2, 8)]
    assert traces == [(2, 4), (2, 8)]  # one trace per bucket, not per batch

    def want(rows: list[int], lengths: list[int]) -> int:
        return sum(sum(range(i * 100, i * 100 + lengths[i])) + i for i in rows)

    lengths = [2, 3, 7, 1, 8, 6]
    assert totals == [want([0, 1], lengths), want([2, 3], lengths), want([4, 5], lengths)]
    assert task_of(client, partition).acked == 6


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting for the cluster's stats"
        time.sleep(0.02)


def test_prefetch_reads_one_batch_ahead_and_close_gives_it_back(
    client: Client, partition: str
) -> None:
    put_xs(client, partition, 10)
    it = ExperienceIterator(client, ["x"], 2, partition=partition, prefetch=1)
    held = next(it)
    wait_for(lambda: task_of(client, partition).leased == 4)  # the held batch and one ahead
    time.sleep(0.3)
    assert task_of(client, partition).leased == 4  # one batch ahead, not more
    second = next(it)  # taken from the prefetcher; the first is acked
    assert np.asarray(held["x"]).tolist() == [0, 1]
    assert np.asarray(second["x"]).tolist() == [2, 3]
    wait_for(lambda: task_of(client, partition).leased == 4)
    started = time.monotonic()
    it.close()
    assert time.monotonic() - started < 2.0
    task = task_of(client, partition)
    assert (task.leased, task.acked, task.available) == (2, 2, 6)  # what the consumer holds
    it.ack(second)


def test_close_with_the_prefetcher_waiting_for_rows(client: Client, partition: str) -> None:
    """The prefetcher waits on an empty partition: close() returns at once and rows put later
    are not taken by it."""
    put_xs(client, partition, 4)
    it = ExperienceIterator(client, ["x"], 2, partition=partition, prefetch=1)
    held = next(it)
    wait_for(lambda: task_of(client, partition).leased == 4)  # then it waits for more rows
    started = time.monotonic()
    it.close()
    assert time.monotonic() - started < 2.0
    assert task_of(client, partition).leased == 2
    put_xs(client, partition, 2, start=4)
    time.sleep(0.5)
    task = task_of(client, partition)
    assert (task.leased, task.available) == (2, 4)
    it.ack(held)
    assert np.asarray(next(it)["x"]).tolist() == [2, 3]  # reading on after close() works
    it.close()


def timed_out(partition: str) -> str:
    return (
        f"get_meta(partition={partition!r}, task='actor', fields=['x'], batch_size=2) timed out "
        f"after 0.2s: "
    )


def test_an_empty_partition_times_out_then_reads_on(client: Client, partition: str) -> None:
    it = ExperienceIterator(client, ["x"], 2, partition=partition, timeout=0.2)
    with pytest.raises(tqstream.RequestTimeoutError) as e:
        next(it)
    assert str(e.value).startswith(timed_out(partition))
    put_xs(client, partition, 2, start=10)
    assert np.asarray(next(it)["x"]).tolist() == [10, 11]


def test_a_timeout_reaches_the_consumer_through_the_prefetcher(
    client: Client, partition: str
) -> None:
    it = ExperienceIterator(client, ["x"], 2, partition=partition, timeout=0.2, prefetch=1)
    with pytest.raises(tqstream.RequestTimeoutError) as e:
        next(it)
    assert str(e.value).startswith(timed_out(partition))
    put_xs(client, partition, 2, start=10)
    try:
        batch = next(it)
    except tqstream.RequestTimeoutError as again:  # a read ahead that began before the put
        assert str(again).startswith(timed_out(partition))
        batch = next(it)  # the next read began after it: it finds the rows
    assert np.asarray(batch["x"]).tolist() == [10, 11]
    it.close()


def test_get_experience_and_async(client: Client, partition: str) -> None:
    put_xs(client, partition, 5)
    it = ExperienceIterator(client, ["x"], 4, partition=partition, ack="manual")
    batch = it.get_experience(3, current_version=2)  # rows of version 0: a lag of 2
    assert np.asarray(batch["x"]).tolist() == [0, 1, 2]
    assert it.ack(batch) == 3

    async def main() -> tuple[list[int], int]:
        writer = ExperienceWriter(client, partition=partition)
        await writer.async_put_experience({"x": np.array([7, 8], np.int32)}, current_version=4)
        got = await it.async_get_experience(4, current_version=4)
        return np.asarray(got["x"]).tolist(), it.ack(got)

    assert asyncio.run(main()) == ([3, 4, 7, 8], 4)
    task = task_of(client, partition)
    assert task.acked == 7 and task.lag == {2: 3, 4: 2, 0: 2}  # each read at its version


# --- objects and bad input ---
def test_object_fields_are_kept_out_of_the_arrays(client: Client, partition: str) -> None:
    ExperienceWriter(client, partition=partition).put_experience(
        {"x": np.array([1, 2], np.int32), "text": np.array(["a prompt", "ünïcode"]),
         "meta": ["x", "yz"]},
        current_version=0,
    )  # fmt: skip
    batch = next(ExperienceIterator(client, ["x", "text", "meta"], 2, partition=partition))
    assert batch.objects == {"text": ["a prompt", "ünïcode"], "meta": ["x", "yz"]}
    assert set(batch) == {"x"} and "text" not in batch
    assert repr(batch) == "JaxBatch(x: int32[2]; 2 rows leased)"


SUPPORTED = (
    "bool, uint8, int8, int16, int32, int64, uint16, uint32, uint64, float16, bfloat16, "
    "float32, float64, complex64, complex128"
)


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        (lambda: jnp.ones(2, dtype=jnp.float8_e4m3fn), "float8_e4m3fn"),
        (lambda: np.ones(2, dtype=ml_dtypes.int4), "int4"),
        (lambda: [np.ones(2, np.int32), np.ones(2, ml_dtypes.float8_e5m2)], "float8_e5m2"),
    ],
    ids=["jax-float8", "numpy-int4", "a-ragged-row-of-float8"],
)
def test_a_dtype_tqstream_lacks_is_refused_and_nothing_stored(
    client: Client, partition: str, make: Callable[[], Any], dtype: str
) -> None:
    writer = ExperienceWriter(client, partition=partition)
    writer.put_experience({"x": np.array([1, 2], np.int32)}, current_version=0)
    with pytest.raises(tqstream.SchemaError) as e:
        writer.put_experience({"x": np.array([3, 4], np.int32), "q": make()}, current_version=0)
    assert str(e.value) == (
        f"field 'q': dtype {dtype} has no tqstream counterpart; cast it to one of {SUPPORTED}"
    )
    stats = client.stats(partition).partitions[partition]
    assert stats.rows == 2 and "q" not in stats.fields  # the first put only


def test_a_deleted_jax_array_is_refused(client: Client, partition: str) -> None:
    writer = ExperienceWriter(client, partition=partition)
    writer.put_experience({"x": np.array([1], np.int32)}, current_version=0)
    donated = jnp.arange(3)
    donated.delete()
    with pytest.raises(tqstream.InvalidRequestError) as e:
        writer.put_experience({"x": [donated]}, current_version=0)
    assert str(e.value) == (
        "field 'x': this jax.Array was deleted (donated to a jitted call or deleted); put it "
        "before donating it, or put a copy"
    )
    with pytest.raises(tqstream.InvalidRequestError) as e:
        writer.put_experience([np.ones(2)], current_version=0)
    assert str(e.value) == "put_experience takes a mapping of field name to arrays, got list"
    assert client.stats(partition).partitions[partition].rows == 1


def test_bad_iterator_arguments(client: Client, partition: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"ack": "sometimes"}, "ack must be 'next' or 'manual', got 'sometimes'"),
        ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
        ({"prefetch": -1}, "prefetch must be an int >= 0, got -1"),
        ({"staleness": StalenessPolicy(max_staleness=1)},
         "a staleness window needs the trainer's version: pass version_fn=lambda: <current "
         "policy version>"),
        ({"sharding": "data"}, "sharding must be a jax.sharding.NamedSharding (e.g. "
         "NamedSharding(mesh, PartitionSpec('data'))) or a SingleDeviceSharding, got str"),
    ]  # fmt: skip
    for kwargs, message in cases:
        args = {"batch_size": 2, **kwargs}
        with pytest.raises(tqstream.InvalidRequestError) as e:
            ExperienceIterator(client, ["x"], partition=partition, **args)
        assert str(e.value) == message


# --- processes: 8 devices, jax.distributed, a killed trainer ---
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mesh_rows(client: Client, partition: str, batches: int) -> dict[str, tuple[list[int], float]]:
    """``batches`` x 8 rows of ragged ``ids`` and a ``reward``; in each 8 rows the first 4
    (leased by whichever process asks first) are short and the last 4 long, so two processes
    reading 4 each see different local longest rows. Returns key -> (ids, reward)."""
    writer = ExperienceWriter(client, partition=partition)
    put: dict[str, tuple[list[int], float]] = {}
    for b in range(batches):
        lengths = [1, 3, 2, 1, 5, 7 + 4 * (b % 2), 6, 5]  # short, then long: longest 7 or 11
        for j, n in enumerate(lengths):
            i = 8 * b + j
            ids = list(range(i * 100 + 1, i * 100 + 1 + n))
            key = f"r{i}"
            writer.put_experience(
                {"ids": [np.array(ids, np.int32)], "reward": np.array([i / 2], np.float32)},
                current_version=0, keys=[key],
            )  # fmt: skip
            put[key] = (ids, i / 2)
    return put


def run_workers(argvs: list[list[str]], env: dict[str, str], logs: Path, timeout: float) -> None:
    """Run one process per argv. The first to fail (or the timeout) kills every other one, which
    would otherwise wait in a collective for its dead peer."""
    procs = []
    for i, argv in enumerate(argvs):
        with (logs / f"worker{i}.log").open("w") as log:
            procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=log))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            assert not failed, (logs / f"worker{failed[0]}.log").read_text()[-4000:]
            assert time.monotonic() < deadline, f"workers still running after {timeout}s"
            time.sleep(0.1)
        for i, p in enumerate(procs):
            assert p.returncode == 0, (logs / f"worker{i}.log").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_global_batch_over_8_devices_of_one_process(
    client: Client, partition: str, tmp_path: Path
) -> None:
    put = mesh_rows(client, partition, 2)
    out = tmp_path / "report.json"
    env = {**WORKER_ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    argv = [str(HERE / "jax_mesh_worker.py"), client.address, partition, "1", "0", "0", "2",
            str(out)]  # fmt: skip
    run_workers([argv], env, tmp_path, timeout=120)
    report = json.loads(out.read_text())
    assert report["devices"] == 8 and report["local_rows"] == 8
    assert report["refused"] == (
        "batch_size=12 does not divide among the 8 shards of the sharding's data axis "
        "(PartitionSpec('data',) over mesh {'data': 8}); use a multiple of 8"
    )
    assert report["spread"] == list(range(16))  # a writer's array over 8 devices: gathered
    seen = []
    for b, batch in enumerate(report["batches"]):
        bucket = 8 if b % 2 == 0 else 16  # the longest row: 7, then 11
        assert batch["shape"] == {"ids": [8, bucket], "ids_lengths": [8], "reward": [8]}
        for name in ("ids", "reward"):  # one global array whose shards sit on the 8 devices
            assert batch["devices"][name] == list(range(8))
            rows = [1, bucket] if name == "ids" else [1]
            assert batch["shards"][name] == [[d, rows] for d in range(8)]
        keys = batch["keys"]
        assert len(keys) == 8
        for key, ids, reward in zip(keys, batch["global"]["ids"], batch["global"]["reward"],
                                    strict=True):  # fmt: skip
            want_ids, want_reward = put[key]
            assert ids == want_ids + [0] * (bucket - len(want_ids)) and reward == want_reward
        assert batch["ids_sum"] == sum(sum(put[k][0]) for k in keys)
        assert batch["reward_sum"] == pytest.approx(sum(put[k][1] for k in keys))
        seen += keys
    assert sorted(seen) == sorted(put)
    assert task_of(client, partition).acked == 16


def test_two_processes_with_jax_distributed_read_disjoint_halves(
    client: Client, partition: str, tmp_path: Path
) -> None:
    batches = 3
    put = mesh_rows(client, partition, batches)
    env = {**WORKER_ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    port = str(free_port())
    outs = [tmp_path / f"report{i}.json" for i in range(2)]
    argvs = [
        [str(HERE / "jax_mesh_worker.py"), client.address, partition, "2", str(i), port,
         str(batches), str(outs[i])]
        for i in range(2)
    ]  # fmt: skip
    run_workers(argvs, env, tmp_path, timeout=180)
    reports = [json.loads(o.read_text()) for o in outs]
    assert [r["devices"] for r in reports] == [8, 8]
    assert [r["local_rows"] for r in reports] == [4, 4]
    for r in reports:  # every process holding the whole batch axis would read each row twice
        assert r["replicated"] == (
            "each process must hold its own share of the batch axis: this one's devices hold 8 "
            "of 8 rows and there are 2 processes; shard the first dimension over every "
            "process's devices (e.g. a mesh over jax.devices() with PartitionSpec('data'))"
        )
    for r in reports:  # a global array a process holds half of cannot be put by it
        assert r["spread"].startswith(
            "field 'x': this jax.Array spans devices of other processes (shape (16,), sharding "
        )
        assert r["spread"].endswith(
            "this process can only read its own shards: put each process's share, e.g. "
            "value.addressable_shards[i].data, from the process that holds it"
        )
    every: list[str] = []
    for b in range(batches):
        mine, theirs = reports[0]["batches"][b], reports[1]["batches"][b]
        bucket = 8 if b % 2 == 0 else 16
        # the local longest rows differ (3 against 7 or 11); both pad to the global one's bucket
        local_longest = sorted(
            max(len(put[k][0]) for k in r["batches"][b]["keys"]) for r in reports
        )
        assert local_longest[0] == 3 and local_longest[1] in (7, 11)
        assert (
            mine["shape"]
            == theirs["shape"]
            == {"ids": [8, bucket], "ids_lengths": [8], "reward": [8]}
        )
        assert mine["devices"]["ids"] == theirs["devices"]["ids"] == list(range(8))
        held = sorted([mine["shards"]["ids"], theirs["shards"]["ids"]])
        assert held == [[[d, [1, bucket]] for d in range(p * 4, p * 4 + 4)] for p in (0, 1)]
        assert len(mine["local"]["ids"]) == len(theirs["local"]["ids"]) == 4
        keys = mine["keys"] + theirs["keys"]
        for r in (mine, theirs):  # each process's share of the global array is its own rows
            for key, ids, n in zip(r["keys"], r["local"]["ids"], r["local"]["ids_lengths"],
                                   strict=True):  # fmt: skip
                assert ids == put[key][0] + [0] * (bucket - len(put[key][0]))
                assert n == len(put[key][0])
            assert r["local"]["reward"] == [put[k][1] for k in r["keys"]]
        total = sum(sum(put[k][0]) for k in keys)  # a jitted sum over the global array
        assert mine["ids_sum"] == theirs["ids_sum"] == total
        assert mine["reward_sum"] == pytest.approx(sum(put[k][1] for k in keys))
        every += keys
    assert sorted(every) == sorted(put) and len(every) == len(set(every))  # each once
    task = task_of(client, partition)
    assert (task.acked, task.leased) == (len(put), 0)


class Lines:
    """A process's stdout lines, read by a thread so that waiting for one has a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        self.seen: list[str] = []

        def pump() -> None:
            for line in stdout:
                self._lines.put(line.rstrip("\n"))
            self._lines.put(None)

        threading.Thread(target=pump, name="test-stdout", daemon=True).start()

    def wait_for(self, wanted: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, f"the process ended before {wanted!r}: {self.seen[-30:]}"
            self.seen.append(line)
            if line == wanted:
                return


def test_a_killed_trainer_resumes_from_its_checkpoint_exactly_once(
    client: Client, partition: str, tmp_path: Path
) -> None:
    """Three runs of one training job: the first two are SIGKILLed in the middle of a step
    (trained, not yet checkpointed), each restart loads the last checkpoint. Counting the
    checkpointed lineage every row is trained on exactly once; the rows of each killed step,
    leased and never acked, come back when their 2 s lease expires and are trained again."""
    n = 15
    with ExperienceWriter(client, partition=partition) as writer:
        for i in range(n):
            writer.put_experience({"x": np.array([i], np.int32)}, current_version=0,
                                  keys=[f"k{i}"])  # fmt: skip
    ckpt, record, final = tmp_path / "ckpt.json", tmp_path / "record.jsonl", tmp_path / "end.json"

    def start(run: int, naming: str, stall_at: int) -> subprocess.Popen[str]:
        argv = [str(HERE / "jax_trainer_worker.py"), client.address, partition, str(ckpt),
                str(record), str(final), str(run), naming, str(stall_at)]  # fmt: skip
        return subprocess.Popen(
            [sys.executable, *argv], env=WORKER_ENV, stdout=subprocess.PIPE, text=True
        )

    runs = [(0, "state_dict", 2), (1, "grain", 2), (2, "state_dict", 0)]
    for run, naming, stall_at in runs:
        proc = start(run, naming, stall_at)
        try:
            lines = Lines(proc)
            if stall_at:
                lines.wait_for(f"trained {stall_at}")  # in the step, not yet checkpointed
                os.kill(proc.pid, signal.SIGKILL)
                assert proc.wait(10) == -signal.SIGKILL
            else:
                lines.wait_for("done", timeout=90)
                assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    steps = [json.loads(line) for line in record.read_text().splitlines()]
    lineage = json.loads(final.read_text())["trained"]
    assert sorted(lineage, key=lambda k: int(k[1:])) == [f"k{i}" for i in range(n)]
    assert len(lineage) == n  # exactly once, counting what the checkpoints kept
    killed = [s["keys"] for s in steps if s["run"] < 2 and s["step"] == 2]
    assert [len(keys) for keys in killed] == [3, 3]  # each killed run lost a trained step
    trained = Counter(k for s in steps for k in s["keys"])
    lost = Counter(k for keys in killed for k in keys)
    assert {k: trained[k] for k in lineage} == {k: 1 + lost[k] for k in lineage}  # re-read
    task = task_of(client, partition)
    assert (task.acked, task.leased) == (n, 0)


def test_grain_names_are_the_checkpoint_methods() -> None:
    assert ExperienceIterator.get_state is ExperienceIterator.state_dict
    assert ExperienceIterator.set_state is ExperienceIterator.load_state_dict


def test_a_checkpoint_taken_just_before_a_kill_resumes_without_rereading(
    client: Client, partition: str
) -> None:
    """Killed after its checkpoint and before asking for the next batch: the checkpoint's batch
    was never acked and its lease ended since. The resumed run acks it (resumed), and neither
    it nor anyone else reads those rows again."""
    writer = ExperienceWriter(client, partition=partition)
    writer.put_experience({"x": np.arange(4, dtype=np.int32)}, current_version=0)
    first = ExperienceIterator(client, ["x"], 2, partition=partition, lease_timeout=0.3)
    trained = next(first)
    state = first.state_dict()  # the checkpoint, then the process dies
    deadline = time.monotonic() + 5
    while task_of(client, partition).leased:  # the dead trainer's lease runs out
        assert time.monotonic() < deadline
        time.sleep(0.05)
    resumed = ExperienceIterator(client, ["x"], 2, partition=partition, timeout=5)
    resumed.load_state_dict(state)
    rest = next(resumed)
    assert sorted(np.asarray(rest["x"]).tolist() + np.asarray(trained["x"]).tolist()) == [
        0,
        1,
        2,
        3,
    ]
    resumed.ack(rest)
    assert task_of(client, partition).consumed == 4
