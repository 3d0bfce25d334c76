"""ragged-put: a put of a rollout's lists of tensors against a dense put of the same bytes.

The ragged batch is 1,024 rollouts with lengths uniform in 1..8,192 (seeded: 4.2 M tokens), three
fields as rollout workers name them: ``input_ids`` int64, ``logprobs`` float32, ``versions`` int32
(-1 on the prompt's first 512 tokens, so each row's version bounds are derived from them), each a
list of one tensor per row, as a rollout has them (67.6 MB). The dense batch holds the same fields
and the same bytes (within 0.1%) as ``[1024, L]`` tensors, ``L`` the mean length. A round is one
``client.put`` of the batch; its rows are cleared before the next round, untimed. Per deployment —
``tqstream-embedded`` (``tqstream.init``), ``tqstream-procs-shm`` (a ``ProcessCluster``, chunks
through /dev/shm) and ``tqstream-procs-tcp`` (the same, bytes over TCP) — the two layouts put into
partitions of their own on one cluster; ``memcpy`` is the floor, no data plane: each field copied
once into buffers made beforehand (a ragged field row by row, with its offsets).

The ratio to read is ragged / dense on one deployment: what handing over lists of rows costs
instead of one tensor per field — with each row copied once, straight into the segment or frame
that carries it, the rows' checks and offsets, their version bounds, and reading the rows from
wherever they lie. Where they lie is the ``placement`` (``rollout``: a row's three tensors made one
after the other, as an engine hands trajectories over; ``compact``: a field's rows views of one
tensor), and memcpy's ratio shows what it costs with nothing else around.

    python -m pytest benchmarks/test_ragged_put.py --benchmark-json=FILE
    python -m benchmarks.test_ragged_put FILE                      # medians and ratios
    python -m benchmarks.test_ragged_put --interleave [TURNS [BLOCK]] [DEPLOYMENT ...] [compact]
"""

from __future__ import annotations

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

import tqstream
from benchmarks._systems import settle
from benchmarks._workload import quick

GROUP = "ragged-put"
DEPLOYMENTS = ("tqstream-embedded", "tqstream-procs-shm", "tqstream-procs-tcp", "memcpy")
LAYOUTS = ("ragged", "dense")
FIELDS = ("input_ids", "logprobs", "versions")
ROWS, MAX_LENGTH = 1024, 8192
QUICK_ROWS, QUICK_MAX_LENGTH = 16, 256
PROMPT = 512  # tokens of each rollout carrying version -1
VERSION = 7  # of every other token
SEED = 8192
ROUNDS, WARMUP = 20, 3
TARGET = 1.2  # ragged <= 1.2x the dense put of the same bytes


# --- workload ------------------------------------------------------------------------------------
class Batches:
    """The two inputs of a round: ``ragged`` (field -> list of rows) and ``dense`` (field ->
    ``[rows, L]``), the same values up to the rows' lengths.

    ``placement``: ``"rollout"``, each row's three tensors made one after the other, as an engine
    hands over each trajectory it finished (a field's rows lie among the other fields' rows); or
    ``"compact"``, a field's rows views of one tensor, back to back (an engine that decodes a
    batch into one buffer and splits it)."""

    def __init__(
        self, rows: int, max_length: int, placement: str = "rollout", seed: int = SEED
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, max_length + 1, (rows,), generator=gen).tolist()
        self.tokens = sum(lengths)
        self.placement = placement
        make = {
            "input_ids": lambda n: torch.randint(0, 151_000, (n,), generator=gen),
            "logprobs": lambda n: -5 * torch.rand(n, generator=gen),
            "versions": _versions,
        }
        self.ragged: dict[str, list[torch.Tensor]] = {f: [] for f in FIELDS}
        for n in lengths:
            for f in FIELDS:
                self.ragged[f].append(make[f](n))
        if placement == "compact":
            for f in FIELDS:
                self.ragged[f] = list(torch.split(torch.cat(self.ragged[f]), lengths))
        length = max(1, round(self.tokens / rows))
        self.dense: dict[str, torch.Tensor] = {
            "input_ids": torch.randint(0, 151_000, (rows, length), generator=gen),
            "logprobs": -5 * torch.rand(rows, length, generator=gen),
            "versions": _versions(length).expand(rows, length).contiguous(),
        }
        self.rows, self.length = rows, length

    def nbytes(self, layout: str) -> int:
        if layout == "dense":
            return sum(t.nbytes for t in self.dense.values())
        return sum(t.nbytes for rows in self.ragged.values() for t in rows)

    def data(self, layout: str) -> dict[str, Any]:
        return dict(self.ragged) if layout == "ragged" else dict(self.dense)


def _versions(n: int) -> torch.Tensor:
    versions = torch.full((n,), VERSION, dtype=torch.int32)
    versions[: min(PROMPT, n)] = -1
    return versions


def batches(placement: str = "rollout") -> Batches:
    rows, length = (QUICK_ROWS, QUICK_MAX_LENGTH) if quick() else (ROWS, MAX_LENGTH)
    return Batches(rows, length, placement)


# --- a deployment --------------------------------------------------------------------------------
class Store:
    """One deployment and a client of it, with a partition per layout; ``put`` is a timed round,
    ``clear`` (untimed) drops what the last one stored. ``memcpy`` is the floor, no data plane:
    each field copied once into buffers made beforehand (a ragged field's rows back to back, and
    their offsets), no version bounds."""

    def __init__(self, deployment: str, b: Batches) -> None:
        self.deployment = deployment
        self.cluster: Any = None
        self.client: Any = None
        self._last: Any = None
        if deployment == "memcpy":
            self.buffers = {
                "ragged": {f: torch.empty(sum(r.shape[0] for r in b.ragged[f]),
                                          dtype=b.ragged[f][0].dtype) for f in FIELDS},
                "dense": {f: torch.empty_like(t) for f, t in b.dense.items()},
            }  # fmt: skip
            self.offsets = np.zeros(b.rows + 1, np.int64)
            return
        if deployment == "tqstream-embedded":
            self.client = tqstream.init(storage_units=1)
        else:
            memory = "auto" if deployment == "tqstream-procs-shm" else "off"
            self.cluster = tqstream.ProcessCluster(storage_units=1)
            config = tqstream.ClientConfig(shared_memory=memory)
            self.client = tqstream.connect(self.cluster.address, config=config)
        for layout in LAYOUTS:
            self.client.create_partition(f"{GROUP}-{layout}", list(FIELDS))

    def put(self, layout: str, data: dict[str, Any]) -> None:
        if self.client is None:
            self._copy(layout, data)
            return
        # rows without a generated token (shorter than the prompt) take version=
        self._last = self.client.put(data, f"{GROUP}-{layout}", version=VERSION)

    def _copy(self, layout: str, data: dict[str, Any]) -> None:
        for field, value in data.items():
            if layout == "dense":
                self.buffers[layout][field].copy_(value)
            else:
                torch.cat(value, out=self.buffers[layout][field])
                np.cumsum([t.shape[0] for t in value], out=self.offsets[1:])

    def clear(self) -> None:
        if self._last is not None:
            self.client.clear_samples(self._last)
            self._last = None

    def check(self, layout: str, b: Batches) -> None:
        """One round, untimed: the rows come back as put, with the version bounds the
        per-token versions give."""
        self.put(layout, b.data(layout))
        if self.client is None:
            return
        meta = self._last
        assert len(meta) == b.rows and meta.version_start is not None
        assert all(v == VERSION for v in meta.version_start + meta.version_end)
        got = self.client.get_by_keys(f"{GROUP}-{layout}", list(meta.keys), list(FIELDS))
        for field in FIELDS:
            value = got.data[field]
            rows = list(value.unbind()) if value.is_nested else list(value)
            want = b.ragged[field] if layout == "ragged" else list(b.dense[field])
            assert all(torch.equal(x, y) for x, y in zip(rows, want, strict=True)), field
        self.clear()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()


# --- the benchmark -------------------------------------------------------------------------------
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store" in metafunc.fixturenames:
        raw = metafunc.config.getoption("--bench-systems")
        named = {n.strip() for n in raw.split(",") if n.strip()}
        chosen: list[Any] = [d for d in DEPLOYMENTS if not named or d in named]
        if not chosen:
            reason = f"--bench-systems names none of {', '.join(DEPLOYMENTS)}"
            chosen = [pytest.param("none", marks=pytest.mark.skip(reason=reason))]
        metafunc.parametrize("store", chosen, indirect=True, scope="module")


@pytest.fixture(scope="module")
def data() -> Batches:
    return batches()


@pytest.fixture(scope="module")
def store(request: pytest.FixtureRequest, data: Batches) -> Iterator[Store]:
    s = Store(request.param, data)
    try:
        if not quick():
            settle()
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ragged_put(benchmark: Any, store: Store, data: Batches, layout: str) -> None:
    rounds, warmup = (1, 0) if quick() else (ROUNDS, WARMUP)
    benchmark.group = GROUP
    benchmark.extra_info.update(
        system=f"{store.deployment}/{layout}",
        mode=store.deployment,
        layout=layout,
        case=f"B={data.rows}, {data.tokens} tokens, 3 fields ({layout}, {data.placement} rows)",
        bytes=data.nbytes(layout),
        batch=data.rows,
    )
    store.check(layout, data)
    value = data.data(layout)
    benchmark.pedantic(
        store.put, args=(layout, value), setup=store.clear, rounds=rounds,
        warmup_rounds=warmup, iterations=1,
    )  # fmt: skip
    store.clear()


# --- summaries -----------------------------------------------------------------------------------
def table(medians: dict[tuple[str, str], float]) -> list[str]:
    """Markdown rows: per deployment the two medians and ragged / dense."""
    lines = ["| deployment | ragged | dense | ragged / dense |", "|---|---:|---:|---:|"]
    for d in DEPLOYMENTS:
        if (d, "ragged") in medians and (d, "dense") in medians:
            r, dense = medians[d, "ragged"], medians[d, "dense"]
            met = "met" if r / dense <= TARGET else "missed"
            lines.append(
                f"| `{d}` | {r * 1e3:.3g} ms | {dense * 1e3:.3g} ms | {r / dense:.3g}x ({met}) |"
            )
    return lines


def summary(doc: dict[str, Any]) -> str:
    medians = {
        (b["extra_info"]["mode"], b["extra_info"]["layout"]): b["stats"]["median"]
        for b in doc.get("benchmarks", [])
        if b.get("group") == GROUP
    }
    if not medians:
        return f"no {GROUP} results"
    return "\n".join([f"target ragged <= {TARGET}x dense", "", *table(medians)])


def interleaved(
    turns: int, block: int, deployments: tuple[str, ...] = DEPLOYMENTS, placement: str = "rollout"
) -> str:
    """Markdown: on each deployment the two layouts take turns of ``block`` puts, ``turns`` turns
    each after a warm-up turn (a drift of the machine hits both alike)."""
    b = batches(placement)
    medians: dict[tuple[str, str], float] = {}
    for deployment in deployments:
        store = Store(deployment, b)
        try:
            for layout in LAYOUTS:
                store.check(layout, b)
            settle()
            times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
            for turn in range(turns + 1):
                for layout in LAYOUTS:
                    value = b.data(layout)
                    for _ in range(block):
                        t0 = time.perf_counter()
                        store.put(layout, value)
                        took = time.perf_counter() - t0
                        store.clear()
                        if turn:
                            times[layout].append(took)
            for layout in LAYOUTS:
                medians[deployment, layout] = statistics.median(times[layout])
        finally:
            store.close()
    head = (
        f"B={b.rows}, {b.tokens} tokens ({b.nbytes('ragged') / 1e6:.3g} MB ragged, "
        f"{b.nbytes('dense') / 1e6:.3g} MB dense), {placement} rows, {turns} turns of {block} puts"
    )
    return "\n".join([head, "", *table(medians)])


PLACEMENTS = ("rollout", "compact")

if __name__ == "__main__":
    if sys.argv[1:2] == ["--interleave"]:
        torch.set_num_threads(1)
        args = sys.argv[2:]
        counts = [int(a) for a in args if a.isdigit()][:2]
        turns, block = counts + [15, 5][len(counts) :]
        where = next((a for a in args if a in PLACEMENTS), "rollout")
        chosen = tuple(a for a in args if not a.isdigit() and a not in PLACEMENTS) or DEPLOYMENTS
        print(interleaved(turns, block, chosen, where))
    elif len(sys.argv) == 2:
        print(summary(json.loads(Path(sys.argv[1]).read_text())))
    else:
        sys.exit(
            "usage: python -m benchmarks.test_ragged_put BENCHMARK_JSON\n"
            "       python -m benchmarks.test_ragged_put --interleave [TURNS [BLOCK]] "
            "[DEPLOYMENT ...] [rollout|compact]"
        )
