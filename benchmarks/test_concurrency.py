"""concurrency: 8 producer threads put 16 batches of 64 rows each (L=128) while 4 consumer tasks
each read every row exactly once, 64 at a time; one round is the whole exchange, from the first
put to the partition dropped. Each round checks no row was lost or read twice by any task."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from benchmarks._systems import System, TaskSystem
from benchmarks._workload import CONCURRENCY, make_batch, row_ids


def test_concurrency(benchmark: Any, system: System) -> None:
    if not isinstance(system, TaskSystem):
        pytest.skip(f"{system.name}: not applicable (no consumer-task semantics)")
    cc = CONCURRENCY.sized()
    batches = [
        [
            make_batch(cc.rows, cc.length, first_id=(p * cc.puts + k) * cc.rows)
            for k in range(cc.puts)
        ]
        for p in range(cc.producers)
    ]
    native = [[system.prepare(b) for b in row] for row in batches]
    tasks = [f"task{i}" for i in range(cc.tasks)]
    names = (f"concurrency-{i}" for i in itertools.count())
    received: list[list[list[int]]] = []

    def setup() -> tuple[tuple[str], dict[str, Any]]:
        partition = next(names)
        system.create(partition, tasks)
        return (partition,), {}

    def produce(partition: str, producer: int) -> None:
        for data in native[producer]:
            system.put_rows(partition, data)

    def consume(partition: str, task: str) -> list[int]:
        ids: list[int] = []
        while len(ids) < cc.total:
            data, token = system.take(partition, cc.rows, task)
            ids += row_ids(data)
            system.ack(token)
        return ids

    with ThreadPoolExecutor(cc.producers + cc.tasks, thread_name_prefix="bench") as pool:

        def exchange(partition: str) -> None:
            readers = [pool.submit(consume, partition, t) for t in tasks]
            writers = [pool.submit(produce, partition, p) for p in range(cc.producers)]
            for w in writers:
                w.result()
            received.append([r.result() for r in readers])
            system.drop(partition)

        benchmark.group = "concurrency"
        benchmark.extra_info.update(
            system=system.name,
            mode=system.mode,
            note=system.note,
            case=f"{cc.producers}x{cc.puts}x{cc.rows} rows L={cc.length}, {cc.tasks} tasks",
            bytes=sum(b.nbytes for row in batches for b in row),
            batch=cc.rows,
            length=cc.length,
            rows=cc.total,
            tasks=cc.tasks,
        )
        benchmark.pedantic(
            exchange, setup=setup, rounds=cc.rounds, warmup_rounds=cc.warmup, iterations=1
        )
    expected = list(range(cc.total))
    assert received
    for per_task in received:
        for task, ids in zip(tasks, per_task, strict=True):
            assert sorted(ids) == expected, f"{task}: rows lost or read twice"
