"""metadata: latency of one get of 64 rows (L=16) while the partition holds N rows.

Two ways the N rows can be there, both kept at exactly N during the rounds:

- ``backlog``: N rows the measuring task has not read yet; each round puts 64 fresh rows at the
  tail (setup), gets the 64 oldest (measured) and deletes those (next setup): a queue in steady
  state, every get served from an N-row backlog.
- ``retained``: N rows the measuring task already read (marked read in setup, no data fetched),
  still held for another task; each round puts 64 fresh rows, gets them (measured), deletes them.

Only the get is timed (lease / metadata + fetch, tensors materialized). ``first_get_s`` in the
extra info is the untimed first get after the fill, where lazily built per-task state shows up.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from benchmarks._bench import check
from benchmarks._systems import TASK, System, TaskSystem
from benchmarks._workload import METADATA_ROWS, make_batch, quick

BATCH, LENGTH = 64, 16
FILL_CHUNK = 20_000


@pytest.mark.parametrize("mode", ["backlog", "retained"])
@pytest.mark.parametrize("rows", METADATA_ROWS)
def test_metadata(benchmark: Any, system: System, rows: int, mode: str) -> None:
    if not isinstance(system, TaskSystem):
        pytest.skip(f"{system.name}: not applicable (no partitions / consumer-task metadata)")
    if system.max_rows is not None and rows > system.max_rows:
        pytest.skip(f"{system.name}: capped at {system.max_rows} rows: {system.max_rows_reason}")
    partition = f"meta-{rows}-{mode}"
    system.create(partition, [TASK] if mode == "backlog" else [TASK, "other"])
    try:
        chunk = min(rows, FILL_CHUNK)
        filler = system.prepare(make_batch(chunk, LENGTH))
        start = time.perf_counter()
        for _ in range(rows // chunk):
            system.put_rows(partition, filler)
        fill_s = time.perf_counter() - start
        if mode == "retained":
            system.consume(partition, rows, TASK)
        fresh_batch = make_batch(BATCH, LENGTH, first_id=rows)
        fresh = system.prepare(fresh_batch)
        taken: list[Any] = []

        def setup() -> None:
            while taken:
                system.clear(taken.pop())
            system.put_rows(partition, fresh)

        def get() -> Any:
            data, token = system.take(partition, BATCH, TASK)
            taken.append(token)
            return data

        setup()
        start = time.perf_counter()
        first = get()
        first_get_s = time.perf_counter() - start
        if mode == "retained":
            check(fresh_batch, first)

        benchmark.group = "metadata"
        benchmark.extra_info.update(
            system=system.name,
            mode=system.mode,
            note=system.note,
            case=f"N={rows:.0e} {mode}".replace("e+0", "e"),
            rows=rows,
            fill=mode,
            bytes=fresh_batch.nbytes,
            batch=BATCH,
            length=LENGTH,
            fill_s=round(fill_s, 3),
            first_get_s=first_get_s,
        )
        rounds, warmup = (1, 0) if quick() else (30, 3)
        benchmark.pedantic(get, setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)
        while taken:
            system.clear(taken.pop())
        held = system.rows(partition)
        assert held == rows, f"the partition held {held} rows, not {rows}"
    finally:
        system.drop(partition)
