"""The rates of ``tqstream status`` between two samples, and its JSON, without a cluster."""

from __future__ import annotations

import msgspec
import pytest

from tqstream.observe.sample import Sample, Snapshot, lag_summary, rates
from tqstream.types import PartitionStats, Stats, TaskStats, UnitStats


def _part(produced: int, acked: int = 0, freed: int = 0, reg: bool = False) -> PartitionStats:
    task = TaskStats(available=0, leased=0, acked=acked, lag={0: 3, 2: 1})
    return PartitionStats(rows=produced - freed, fields={"x": produced - freed}, schemas={},
                          tasks={"actor": task}, produced=produced, freed=freed,
                          tasks_registered=["actor"] if reg else [])  # fmt: skip


def _sample(clock: float, **parts: PartitionStats) -> Sample:
    units = [UnitStats(address="tcp://127.0.0.1:1", bytes=10, chunks=1, rows=1)]
    return Sample(Stats(partitions=parts, units=units), time=1e9 + clock, clock=clock)


def test_the_first_sample_has_no_rates() -> None:
    r = rates(None, _sample(0.0, p=_part(10, acked=4)))
    assert r.seconds is None
    assert r.partitions["p"].put_rows_per_s is None
    assert r.partitions["p"].tasks["actor"].consume_rows_per_s is None


def test_rates_divide_by_the_time_that_elapsed() -> None:
    r = rates(_sample(10.0, p=_part(10, acked=4)), _sample(12.5, p=_part(60, acked=9)))
    assert r.seconds == 2.5
    assert r.partitions["p"].put_rows_per_s == pytest.approx(20.0)
    assert r.partitions["p"].tasks["actor"].consume_rows_per_s == pytest.approx(2.0)


def test_a_counter_that_went_down_counts_its_new_value() -> None:
    # the partition was cleared and made again: 7 rows since, not -93
    r = rates(_sample(0.0, p=_part(100, acked=50)), _sample(1.0, p=_part(7, acked=2)))
    assert r.partitions["p"].put_rows_per_s == 7.0
    assert r.partitions["p"].tasks["actor"].consume_rows_per_s == 2.0


def test_a_partition_that_appeared_counts_from_zero() -> None:
    r = rates(_sample(0.0), _sample(2.0, q=_part(8, acked=4)))
    assert r.partitions["q"].put_rows_per_s == 4.0
    assert r.partitions["q"].tasks["actor"].consume_rows_per_s == 2.0


def test_rows_freed_after_a_registered_task_acked_them_still_count_as_consumed() -> None:
    # 10 acked, then 8 of them freed (every registered task acked them) and 3 more acked
    before, after = _part(20, acked=10, reg=True), _part(20, 5, 8, reg=True)
    r = rates(_sample(0.0, p=before), _sample(1.0, p=after))
    assert r.partitions["p"].tasks["actor"].consume_rows_per_s == 3.0


def test_lag_summary_is_mean_and_max_of_the_histogram() -> None:
    assert lag_summary(TaskStats(0, 0, 0, lag={0: 3, 2: 1})) == (0.5, 2)
    assert lag_summary(TaskStats(0, 0, 0)) is None


def test_a_snapshot_is_json_that_decodes_as_its_stats() -> None:
    prev, cur = _sample(0.0, p=_part(4)), _sample(1.0, p=_part(6))
    raw = msgspec.json.encode(Snapshot.of("tcp://h:1", cur, rates(prev, cur)))
    assert msgspec.json.decode(raw, type=Stats) == cur.stats
    plain = msgspec.json.decode(raw)
    assert plain["address"] == "tcp://h:1" and plain["time"] == cur.time
    actor = {"consume_rows_per_s": 0.0}
    assert plain["rates"] == {
        "seconds": 1.0,
        "partitions": {"p": {"put_rows_per_s": 2.0, "tasks": {"actor": actor}}},
    }
