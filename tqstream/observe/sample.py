"""Samples of ``client.stats()`` and the rates between two of them; no I/O.

A rate is a counter's increase over the seconds actually elapsed between two samples (monotonic
clock), not over the interval asked for: a slow ``stats()`` reply or a late wake-up stretches the
interval, and dividing by the nominal one would overstate the rate. Counters follow the Prometheus
convention for resets: a counter that went down (its partition was cleared and made again) counts
its new value as the increase, so a rate is never negative.
"""

from __future__ import annotations

import msgspec

from tqstream.types import PartitionStats, Stats, TaskStats, UnitStats

__all__ = ["PartitionRates", "Rates", "Sample", "Snapshot", "TaskRates", "lag_summary", "rates"]


class Sample(msgspec.Struct, frozen=True):
    """One ``stats()`` reply and when it arrived: ``time`` (unix seconds, for people and logs) and
    ``clock`` (``time.monotonic()``, for rates)."""

    stats: Stats
    time: float
    clock: float


class TaskRates(msgspec.Struct, frozen=True):
    consume_rows_per_s: float | None  # rows the task acked per second; None: first sample


class PartitionRates(msgspec.Struct, frozen=True):
    put_rows_per_s: float | None  # rows committed per second; None: first sample
    tasks: dict[str, TaskRates] = {}


class Rates(msgspec.Struct, frozen=True):
    """The rates between two samples; ``seconds`` is the time between them (None, and every rate
    None, for the first sample: a rate needs two)."""

    seconds: float | None
    partitions: dict[str, PartitionRates] = {}


class Snapshot(msgspec.Struct, frozen=True):
    """What ``tqstream status --json`` prints: the ``Stats`` fields at the top level (so a line
    decodes as a ``Stats`` too), where they came from and when, and the rates."""

    address: str
    time: float
    partitions: dict[str, PartitionStats]
    units: list[UnitStats]
    admissions: dict[str, dict[str, int | float | str]]
    uptime: float
    rates: Rates

    @classmethod
    def of(cls, address: str, sample: Sample, rates: Rates) -> Snapshot:
        s = sample.stats
        return cls(address, sample.time, s.partitions, s.units, s.admissions, s.uptime, rates)


def consumed(p: PartitionStats, task: str, t: TaskStats) -> int:
    """Rows ``task`` acked in all. ``acked`` counts only the acked rows still held; a row every
    registered task acked is freed and leaves their ``acked``, so for a registered task the freed
    rows are added back. A ``consumed`` count reported by the controller is exact and never below
    that (it counts those rows and more: acked rows evicted since), so it wins where present."""
    estimate = t.acked + (p.freed if task in p.tasks_registered else 0)
    reported = getattr(t, "consumed", None)
    return max(reported, estimate) if isinstance(reported, int) else estimate


def _increase(now: int, before: int) -> int:
    return now if now < before else now - before


def rates(prev: Sample | None, cur: Sample) -> Rates:
    """The rates from ``prev`` to ``cur`` for every partition and task in ``cur``; one that was
    not in ``prev`` counts from zero (it appeared in between)."""
    seconds = None if prev is None else cur.clock - prev.clock
    out = {}
    for name, p in cur.stats.partitions.items():
        before = None if prev is None else prev.stats.partitions.get(name)
        tasks = {}
        for task, t in p.tasks.items():
            rate = None
            if seconds is not None and seconds > 0:
                b = before.tasks.get(task) if before is not None else None
                old = consumed(before, task, b) if before is not None and b is not None else 0
                rate = _increase(consumed(p, task, t), old) / seconds
            tasks[task] = TaskRates(rate)
        put = None
        if seconds is not None and seconds > 0:
            put = _increase(p.produced, before.produced if before is not None else 0) / seconds
        out[name] = PartitionRates(put, tasks)
    return Rates(seconds, out)


def lag_summary(t: TaskStats) -> tuple[float, int] | None:
    """Mean and max version lag of the rows ``t`` consumed with a version (None: none yet)."""
    rows = sum(t.lag.values())
    if not rows:
        return None
    return sum(lag * n for lag, n in t.lag.items()) / rows, max(t.lag)
