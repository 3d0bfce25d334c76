"""jax-get: a trainer's get of a verl-sized batch into padded arrays, through tqstream's JAX
adapter, through its torch padded get, by hand in numpy, and the memcpy floor, side by side.

The batch is 1,024 rollouts with lengths uniform in 1..8,192 (seeded: 4.2 M tokens), three ragged
fields as rollout workers name them: ``input_ids`` int64, ``logprobs`` float32, ``versions`` int32
(-1 on the prompt's tokens), 67.6 MB. It is put once, untimed, into an embedded tqstream
(``tqstream.init(storage_units=1)``: its chunks lie in /dev/shm segments the get maps). A round
leases the 1,024 rows and turns them into padded arrays, pads ``input_ids`` 0, ``logprobs`` 0,
``versions`` -1; the lease is ended after the round, untimed (``reset_consumption``), so every
round reads the same rows. Per system:

- ``tqstream-jax``: ``ExperienceIterator.get_experience()`` with buckets (1024, 2048, 4096, 8192):
  a ``JaxBatch`` of ``[1024, 8192]`` arrays plus ``<field>_lengths``, ``jax.block_until_ready``
  on it inside the round. JAX's default 32-bit mode: ``input_ids`` is range-checked and comes back
  int32;
- ``tqstream-jax-x64``: the same with 64-bit types on (``with jax.enable_x64(True)``, a
  thread-local scope around this system's rounds; the others run in ``jax.enable_x64(False)``,
  whatever ``JAX_ENABLE_X64`` says): ``input_ids`` stays int64;
- ``tqstream-torch-padded``: ``client.get(..., padded=True)``: torch tensors padded to the longest
  row, and int64 lengths;
- ``numpy-by-hand``: what a JAX trainer without the adapter writes: ``client.get`` (inside the
  round), each field's column split into a list of per-row numpy arrays, a
  ``np.full((B, bucket), pad)`` filled row by row in a Python loop, then ``jnp.asarray`` (int64
  narrowed by JAX, unchecked) and ``jax.block_until_ready``;
- ``memcpy``: the floor, no data plane: ``np.zeros`` of each field's padded shape (stored dtypes,
  the bucket's length; ``np.full`` for the -1 of ``versions``) and each row copied into it once,
  from plain memory (the rows' values back to back).

Once per system, outside the timed rounds, the arrays are compared with the rows put (values,
padding and lengths), and the JAX arrays with ``client.get(..., padded=True)``'s tensors.

    python -m pytest benchmarks/test_jax.py --benchmark-json=FILE
    python -m benchmarks.test_jax FILE                     # medians and the targets' ratios
    python -m benchmarks.test_jax --interleave [TURNS [BLOCK]]   # the systems taking turns
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks._systems import settle
from benchmarks._workload import quick

pytest.importorskip("jax", reason="jax-get needs jax (pip install -e '.[jax]')")

import jax
import jax.numpy as jnp

import tqstream
from tqstream.adapters.jax import ExperienceIterator

GROUP = "jax-get"
SYSTEMS = ("tqstream-jax", "tqstream-jax-x64", "tqstream-torch-padded", "numpy-by-hand", "memcpy")
FIELDS = ("input_ids", "logprobs", "versions")
PAD = {"input_ids": 0, "logprobs": 0.0, "versions": -1}
ROWS, MAX_LENGTH, BUCKETS = 1024, 8192, (1024, 2048, 4096, 8192)
QUICK_ROWS, QUICK_MAX_LENGTH, QUICK_BUCKETS = 16, 256, (64, 128, 256)
PROMPT = 512  # tokens of each rollout carrying version -1
SEED = 8192
ROUNDS, WARMUP = 20, 2
PARTITION = GROUP
WAIT = 120.0
NOTES = {
    "tqstream-jax": "ExperienceIterator.get_experience() with buckets (1024, 2048, 4096, 8192), "
    "JAX's default 32-bit mode (int64 input_ids range-checked, int32 back), "
    "jax.block_until_ready; one copy per row into an aligned buffer the jax.Array aliases",
    "tqstream-jax-x64": "the same with jax.enable_x64(True): input_ids stays int64",
    "tqstream-torch-padded": "client.get(..., padded=True): torch tensors padded to the longest "
    "row (torch.full + one scatter of the values), int64 lengths",
    "numpy-by-hand": "client.get, each column split into per-row numpy arrays, np.full((B, "
    "bucket), pad) filled in a Python loop, jnp.asarray, jax.block_until_ready",
    "memcpy": "np.zeros of each field's padded shape (np.full for versions' -1) and each row "
    "copied into it once, from plain memory: the floor, no data plane",
}


# --- workload ------------------------------------------------------------------------------------
class Rollouts:
    """The batch: ``rows`` rollouts of lengths uniform in 1..``max_length``, per field the values
    back to back (``flat``) and the per-row tensors put (views of ``flat``)."""

    def __init__(self, rows: int, max_length: int, seed: int = SEED) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, max_length + 1, (rows,), generator=gen)
        total = int(self.lengths.sum())
        self.offsets = torch.zeros(rows + 1, dtype=torch.int64)
        self.offsets[1:] = self.lengths.cumsum(0)
        versions = torch.empty(total, dtype=torch.int32)
        starts = self.offsets[:-1].tolist()
        for i, (start, n) in enumerate(zip(starts, self.lengths.tolist(), strict=True)):
            versions[start : start + n] = 7 - i % 3  # rollouts of the last three policies
            versions[start : start + min(PROMPT, n)] = -1
        self.flat = {
            "input_ids": torch.randint(0, 151_000, (total,), generator=gen, dtype=torch.int64),
            "logprobs": -5 * torch.rand(total, generator=gen),
            "versions": versions,
        }
        split = self.lengths.tolist()
        self.rows = {name: list(torch.split(t, split)) for name, t in self.flat.items()}
        self.bucket = next(b for b in buckets() if b >= int(self.lengths.max()))

    @property
    def n(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())

    def padded_nbytes(self, x64: bool = True) -> int:
        """Bytes of the padded output at the bucket's length (``x64=False``: int64 as int32)."""
        width = {n: (4 if n == "input_ids" and not x64 else t.element_size())
                 for n, t in self.flat.items()}  # fmt: skip
        return self.n * self.bucket * sum(width.values())


def buckets() -> tuple[int, ...]:
    return QUICK_BUCKETS if quick() else BUCKETS


def check(name: str, arrays: dict[str, np.ndarray], lengths: np.ndarray, r: Rollouts) -> None:
    """``arrays`` (field -> ``[B, >= longest]``) hold the rows put, then the pad; ``lengths``
    each row's."""
    assert np.array_equal(lengths, r.lengths.numpy()), f"{name}: lengths differ"
    longest = int(r.lengths.max())
    for field in FIELDS:
        got = arrays[field]
        assert got.shape[0] == r.n and got.shape[1] >= longest, (name, field, got.shape)
        want = np.full((r.n, got.shape[1]), PAD[field], dtype=got.dtype)
        for i, row in enumerate(r.rows[field]):
            want[i, : row.shape[0]] = row.numpy()
        assert np.array_equal(got, want), f"{name}: {field} came back different"


# --- systems -------------------------------------------------------------------------------------
class Reader:
    """One system: ``read()`` is a timed round (the arrays are kept in ``out``), ``reset()``
    (untimed) drops them and makes the rows readable again."""

    def __init__(self, name: str, client: Any, rollouts: Rollouts) -> None:
        self.name, self.client, self.r = name, client, rollouts
        self.task = name
        self.out: Any = None
        if name.startswith("tqstream-jax"):
            self.it = ExperienceIterator(
                client, list(FIELDS), rollouts.n, partition=PARTITION, task=name,
                buckets=buckets(), pad_values=PAD, timeout=WAIT,
            )  # fmt: skip
        if name == "memcpy":
            self.src = {f: t.numpy() for f, t in rollouts.flat.items()}
            self.bounds = rollouts.offsets.tolist()

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """JAX's 64-bit types on for the x64 variant, off for the others whatever the
        environment says (``JAX_ENABLE_X64``): a setting scoped to this thread, undone after."""
        return jax.enable_x64(self.name == "tqstream-jax-x64")

    def read(self) -> None:
        if self.name.startswith("tqstream-jax"):
            self.out = jax.block_until_ready(self.it.get_experience())
        elif self.name == "tqstream-torch-padded":
            self.out = self.client.get(
                PARTITION, FIELDS, self.r.n, self.task, padded=True, pad_values=PAD,
                timeout=WAIT,
            ).data  # fmt: skip
        elif self.name == "numpy-by-hand":
            self.out = jax.block_until_ready(self._by_hand())
        else:
            self.out = self._memcpy()

    def _by_hand(self) -> dict[str, Any]:
        batch = self.client.get(PARTITION, FIELDS, self.r.n, self.task, timeout=WAIT)
        assert batch.columns is not None
        out: dict[str, Any] = {}
        for field in FIELDS:
            col = batch.columns[field]
            assert col.offsets is not None
            rows = np.split(col.values.numpy(), col.offsets.numpy()[1:-1])  # views
            longest = max(row.shape[0] for row in rows)
            length = next(b for b in buckets() if b >= longest)
            padded = np.full((len(rows), length), PAD[field], dtype=rows[0].dtype)
            for i, row in enumerate(rows):
                padded[i, : row.shape[0]] = row
            out[field] = jnp.asarray(padded)
            lengths = np.array([row.shape[0] for row in rows], np.int32)
            out[f"{field}_lengths"] = jnp.asarray(lengths)
        return out

    def _memcpy(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        bounds, shape = self.bounds, (self.r.n, self.r.bucket)
        for field, src in self.src.items():
            pad = PAD[field]  # zeros: the kernel's fresh pages are the pad, no fill pass
            dst = np.zeros(shape, src.dtype) if pad == 0 else np.full(shape, pad, src.dtype)
            for i in range(shape[0]):
                start, stop = bounds[i], bounds[i + 1]
                dst[i, : stop - start] = src[start:stop]
            out[field] = dst
        return out

    def reset(self) -> None:
        self.out = None
        if self.name != "memcpy":
            self.client.reset_consumption(PARTITION, self.task)

    def arrays(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The last round's padded arrays as numpy, and the rows' lengths."""
        out = self.out
        if self.name == "memcpy":
            return dict(out), self.r.lengths.numpy()
        lengths = out["input_ids_lengths"]
        for field in FIELDS:  # every field of a row has the row's length
            assert np.array_equal(np.asarray(out[f"{field}_lengths"]), np.asarray(lengths))
        return {f: np.asarray(out[f]) for f in FIELDS}, np.asarray(lengths)

    def close(self) -> None:
        if self.name.startswith("tqstream-jax"):
            self.it.close()
        self.out = None


def start_store(r: Rollouts) -> Any:
    """An embedded tqstream holding the rollouts (one put)."""
    client = tqstream.init(storage_units=1)
    client.create_partition(PARTITION, list(FIELDS))
    client.put(r.rows, PARTITION)
    return client


def check_reader(reader: Reader) -> None:
    """One round, untimed: the arrays against the rows put and, for the JAX systems, against the
    torch padded get's tensors; the dtypes JAX's mode gives."""
    r = reader.r
    with reader.scope():
        reader.read()
        arrays, lengths = reader.arrays()
    check(reader.name, arrays, lengths, r)
    if reader.name.startswith("tqstream-jax"):
        want_ids = "int64" if reader.name.endswith("x64") else "int32"
        assert arrays["input_ids"].dtype == want_ids, arrays["input_ids"].dtype
        assert arrays["input_ids"].shape == (r.n, r.bucket)
        task = f"{reader.name}-check"
        torch_batch = reader.client.get(PARTITION, FIELDS, r.n, task, padded=True, pad_values=PAD)
        reader.client.reset_consumption(PARTITION, task)
        for field in FIELDS:
            t = torch_batch.data[field]
            width = t.shape[1]
            assert np.array_equal(arrays[field][:, :width], t.numpy()), field
            assert (arrays[field][:, width:] == PAD[field]).all(), field
            assert np.array_equal(lengths, torch_batch.data[f"{field}_lengths"].numpy()), field
    reader.reset()


def _chosen(config: pytest.Config) -> list[str]:
    """The systems ``--bench-systems`` names (memcpy, the floor, with any of them)."""
    raw = config.getoption("--bench-systems")
    named = {n.strip() for n in raw.split(",") if n.strip()}
    if not named:
        return list(SYSTEMS)
    chosen = [n for n in SYSTEMS if n in named]
    return [*chosen, "memcpy"] if chosen and "memcpy" not in chosen else chosen


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "reader" in metafunc.fixturenames:
        names: list[Any] = _chosen(metafunc.config)
        if not names:
            reason = f"--bench-systems names none of {', '.join(SYSTEMS)}"
            names = [pytest.param("none", marks=pytest.mark.skip(reason=reason))]
        metafunc.parametrize("reader", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def rollouts() -> Rollouts:
    return Rollouts(QUICK_ROWS, QUICK_MAX_LENGTH) if quick() else Rollouts(ROWS, MAX_LENGTH)


@pytest.fixture(scope="module")
def store(rollouts: Rollouts) -> Iterator[Any]:
    client = start_store(rollouts)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def reader(request: pytest.FixtureRequest, store: Any, rollouts: Rollouts) -> Iterator[Reader]:
    system = Reader(request.param, store, rollouts)
    try:
        if not quick():
            settle()
        yield system
    finally:
        system.close()


# --- the benchmark -------------------------------------------------------------------------------
def test_jax_get(benchmark: Any, reader: Reader, rollouts: Rollouts) -> None:
    r = rollouts
    rounds, warmup = (1, 0) if quick() else (ROUNDS, WARMUP)
    x64 = reader.name in ("tqstream-torch-padded", "memcpy", "tqstream-jax-x64")
    benchmark.group = GROUP
    benchmark.extra_info.update(
        system=reader.name,
        mode=reader.name,
        note=NOTES[reader.name],
        case=f"B={r.n} ragged L 1-{int(r.lengths.max())}, 3 fields, bucket {r.bucket}",
        bytes=r.nbytes,
        padded_bytes=r.padded_nbytes(x64),
        batch=r.n,
        length=r.bucket,
        tokens=int(r.lengths.sum()),
    )
    check_reader(reader)
    with reader.scope():
        benchmark.pedantic(
            reader.read, teardown=reader.reset, rounds=rounds, warmup_rounds=warmup, iterations=1
        )


# --- summary from a --benchmark-json -------------------------------------------------------------
TARGETS = (("tqstream-jax", "tqstream-torch-padded", 1.2), ("tqstream-jax", "memcpy", 2.0))


def table(medians: dict[str, float], ref: str = "memcpy") -> list[str]:
    """Markdown rows: each system's median and its time over the torch padded get's and over
    memcpy's."""
    order = [s for s in SYSTEMS if s in medians]
    head = ["system", "median", "/ tqstream-torch-padded", f"/ {ref}"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|"]
    for name in order:
        m = medians[name]
        torch_ratio = m / medians["tqstream-torch-padded"] if "tqstream-torch-padded" in medians \
            else float("nan")  # fmt: skip
        floor = m / medians[ref] if ref in medians else float("nan")
        lines.append(f"| `{name}` | {m * 1e3:.3g} ms | {torch_ratio:.3g}x | {floor:.3g}x |")
    targets = [(s, o, limit) for s, o, limit in TARGETS if s in medians and o in medians]
    lines += [""] if targets else []
    for system, other, limit in targets:
        ratio = medians[system] / medians[other]
        met = "met" if ratio <= limit else "missed"
        lines.append(f"target {system} <= {limit}x {other}: {ratio:.3g}x, {met}")
    return lines


def summary(doc: dict[str, Any]) -> str:
    found = {
        b["extra_info"]["system"]: b
        for b in doc.get("benchmarks", [])
        if b.get("group") == GROUP and "system" in b.get("extra_info", {})
    }
    if not found:
        return f"no {GROUP} results"
    first = next(iter(found.values()))["extra_info"]
    medians = {name: b["stats"]["median"] for name, b in found.items()}
    head = f"{first['case']}, {first['bytes'] / 1e6:.3g} MB of rows"
    return "\n".join([head, "", *table(medians)])


# --- interleaved: the systems take turns, so a drift of the machine hits them alike ---------------
def interleaved(turns: int = 10, block: int = 2, systems: tuple[str, ...] = SYSTEMS) -> str:
    """Markdown: every system in this one process on one embedded tqstream, taking turns of
    ``block`` rounds, ``turns`` turns each after a warm-up turn."""
    r = Rollouts(QUICK_ROWS, QUICK_MAX_LENGTH) if quick() else Rollouts(ROWS, MAX_LENGTH)
    client = start_store(r)
    readers = [Reader(name, client, r) for name in systems]
    times: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for reader in readers:
            check_reader(reader)
        settle()
        for turn in range(turns + 1):
            for reader in readers:
                with reader.scope():
                    for _ in range(block):
                        t0 = time.perf_counter()
                        reader.read()
                        took = time.perf_counter() - t0
                        reader.reset()
                        if turn:
                            times[reader.name].append(took)
    finally:
        for reader in readers:
            reader.close()
        client.close()
    medians = {name: statistics.median(took) for name, took in times.items()}
    head = f"B={r.n} ragged L 1-{int(r.lengths.max())}, {turns} turns of {block} rounds"
    return "\n".join([head, "", *table(medians)])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interleave"]:
        torch.set_num_threads(1)
        given = [int(a) for a in sys.argv[2:4]]
        turns, block = given + [10, 2][len(given) :]
        print(interleaved(turns, block))
    elif len(sys.argv) == 2:
        print(summary(json.loads(Path(sys.argv[1]).read_text())))
    else:
        sys.exit(
            "usage: python -m benchmarks.test_jax BENCHMARK_JSON\n"
            "       python -m benchmarks.test_jax --interleave [TURNS [BLOCK]]"
        )
