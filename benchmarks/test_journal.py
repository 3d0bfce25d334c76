"""journal: what the controller's write-ahead journal costs (``tqstream/controller/journal.py``).

- ``journal-append``: one loop turn of T requests (T = 1 or 64), each encoding its record (a
  commit of a 256-row put: row ids, field mask, per-row versions; or an ack of 256 rows,
  alternately), appending it and holding its reply until the journal's future for it resolves;
  the round ends when every reply of the turn is released. ``off`` is the same turn with no
  journal (replies released at once, nothing encoded): the difference is the journal's cost per
  request. The records are made before the rounds (the controller encodes state it holds).
  ``batched`` resolves at the write, ``sync`` at the fsync. ``-flush``: the server holds the
  turn's replies to the end of its drain, flushes there and sends them at once when nothing is
  left to wait for (batched), saving the loop iterations of the scheduled flush and the future.
- ``journal-replay``: opening a journal that holds 10^6 rows' worth of records (quick: 10^5) and
  decoding every record, as a restarted controller would before applying them: ``put-256`` (a
  commit, a lease and an ack per 256 rows) and ``put-1`` (a commit per row, as producers that put
  one trajectory at a time make, with a lease and an ack per 256 rows).

Bytes per row (``bytes_per_row``) and records per second are in the extra info.

    python -m pytest benchmarks/test_journal.py --benchmark-json=FILE
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from benchmarks._workload import quick
from tqstream.controller.journal import Journal, JournalConfig

ROWS = 256
CLUSTER = "bench"


class Commit(msgspec.Struct, array_like=True, tag=1):
    partition: str
    put_id: int
    row_ids: bytes  # int64
    fields: int  # the written fields' mask
    version_start: bytes  # int32
    version_end: bytes  # int32


class Lease(msgspec.Struct, array_like=True, tag=2):
    partition: str
    task: str
    lease_id: int
    deadline: float
    row_ids: bytes


class Ack(msgspec.Struct, array_like=True, tag=3):
    partition: str
    task: str
    lease_id: int
    row_ids: bytes


Record = Commit | Lease | Ack
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Record)


def ids(first: int, n: int) -> bytes:
    return np.arange(first, first + n, dtype=np.int64).tobytes()


def commit(put: int, first: int, n: int) -> Commit:
    versions = np.full(n, put // 8, dtype=np.int32).tobytes()
    return Commit("train", put, ids(first, n), 0b11111, versions, versions)


# --- append ---
@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.mark.parametrize("turn", [1, 64])
@pytest.mark.parametrize("durability", ["off", "batched", "batched-flush", "sync", "sync-flush"])
def test_journal_append(
    benchmark: Any, loop: asyncio.AbstractEventLoop, durability: str, turn: int
) -> None:
    flush = durability.endswith("-flush")
    with tempfile.TemporaryDirectory() as directory:
        journal = None
        if durability != "off":
            config = JournalConfig(durability.removesuffix("-flush"))  # type: ignore[arg-type]
            journal, _ = Journal.open(directory, CLUSTER, config)
        state = {"n": 0}
        # the controller encodes records from state it holds: made here, encoded in the round
        pool: list[Any] = [
            commit(n, n * ROWS, ROWS) if n % 2 else Ack("train", "actor", n, ids(n, ROWS))
            for n in range(128)
        ]

        async def one_turn() -> None:
            released = loop.create_future()
            left = [turn]

            def reply(_: Any = None) -> None:
                left[0] -= 1
                if not left[0]:
                    released.set_result(None)

            held = 0
            for _ in range(turn):
                n = state["n"] = state["n"] + 1
                if journal is None:
                    reply()
                    continue
                journal.append(1, ENCODER.encode(pool[n % len(pool)]))
                if flush:  # the server holds its replies to the end of its drain
                    held += 1
                    continue
                wait = journal.durable()
                if wait is None:
                    reply()
                else:
                    wait.add_done_callback(reply)
            if held:
                assert journal is not None
                journal.flush()
                wait = journal.durable()
                for _ in range(held):
                    if wait is None:  # batched: written, the replies go at once
                        reply()
                    else:
                        wait.add_done_callback(reply)
            await released

        def run() -> None:
            loop.run_until_complete(one_turn())

        run()
        benchmark.group = "journal-append"
        benchmark.pedantic(run, rounds=20 if quick() else 300, warmup_rounds=0 if quick() else 20)
        stats = journal.stats() if journal is not None else None
        benchmark.extra_info.update(
            system=f"journal-{durability}", case=f"T={turn}", durability=durability, turn=turn
        )
        if benchmark.stats is not None:  # None under --benchmark-disable
            median = benchmark.stats.stats.median
            benchmark.extra_info.update(
                us_per_request=round(median / turn * 1e6, 2), requests_per_s=round(turn / median)
            )
        if stats is not None:
            benchmark.extra_info.update(
                bytes_per_row=round(stats.bytes / (stats.records * ROWS), 2),
                writes_per_turn=round(stats.writes / (stats.records / turn), 3),
                fsyncs=stats.fsyncs,
            )
            journal.close()  # type: ignore[union-attr]


# --- replay ---
def fill(directory: str, rows: int, per_put: int) -> tuple[int, int]:
    """A journal of ``rows`` rows put ``per_put`` at a time, leased and acked 256 at a time;
    (records, bytes on disk)."""

    async def run() -> int:
        journal, _ = Journal.open(directory, CLUSTER, JournalConfig("batched"))
        records = 0
        for first in range(0, rows, ROWS):
            for start in range(first, first + ROWS, per_put):
                journal.append(1, ENCODER.encode(commit(start, start, per_put)))
            lease = Lease("train", "actor", first, 1e9, ids(first, ROWS))
            journal.append(2, ENCODER.encode(lease))
            journal.append(3, ENCODER.encode(Ack("train", "actor", first, ids(first, ROWS))))
            records += ROWS // per_put + 2
            if first % (64 * ROWS) == 0:
                journal.flush()
        journal.close()
        return records

    records = asyncio.run(run())
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    return records, size


@pytest.fixture(scope="module")
def journals() -> Iterator[dict[str, tuple[str, int, int]]]:
    rows = 100_000 if quick() else 1_000_000
    with tempfile.TemporaryDirectory() as root:
        made = {}
        for case, per_put in (("put-256", ROWS), ("put-1", 1)):
            directory = os.path.join(root, case)
            made[case] = (directory, *fill(directory, rows, per_put))
        yield made


@pytest.mark.parametrize("case", ["put-256", "put-1"])
def test_journal_replay(
    benchmark: Any, journals: dict[str, tuple[str, int, int]], case: str
) -> None:
    directory, records, size = journals[case]
    rows = 100_000 if quick() else 1_000_000

    def replay() -> int:
        journal, found = Journal.open(directory, CLUSTER)
        decode, n = DECODER.decode, 0
        for _, payload in found:
            decode(payload)
            n += 1
        journal.close()
        return n

    assert replay() == records
    benchmark.group = "journal-replay"
    benchmark.pedantic(replay, rounds=1 if quick() else 5, warmup_rounds=0)
    benchmark.extra_info.update(
        system="journal",
        case=f"{case} N={rows:.0e}".replace("e+0", "e"),
        rows=rows,
        records=records,
        bytes=size,
        bytes_per_row=round(size / rows, 2),
    )
    if benchmark.stats is not None:  # None under --benchmark-disable
        median = benchmark.stats.stats.median
        benchmark.extra_info.update(records_per_s=round(records / median), seconds=round(median, 3))
