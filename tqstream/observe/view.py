"""The ``tqstream status`` screen: a header and four tables drawn with rich from one sample.

Every number comes from the sample (``client.stats()``) or from the rates between it and the one
before; a rate that needs a sample not taken yet shows as ``-``. An empty section is one dim line
instead of an empty table, so a fresh cluster reads "no partitions yet" rather than a bare frame.
"""

from __future__ import annotations

import datetime

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tqstream.observe.sample import Rates, Sample, consumed, lag_summary
from tqstream.types import PartitionStats, Stats, _size

__all__ = ["render"]


def render(
    address: str,
    sample: Sample | None,
    rates: Rates | None,
    *,
    interval: float,
    error: str | None = None,
) -> Group:
    """The whole screen. ``sample`` None: nothing arrived yet; ``error``: why watching stopped
    (shown above the last sample, which stays on screen)."""
    parts: list[RenderableType] = [_header(address, sample, interval)]
    if error is not None:
        parts.append(Text(error, style="bold red"))
    if sample is not None:
        s = sample.stats
        parts += [
            _partitions(s, rates),
            _tasks(s, rates),
            _units(s),
            _admissions(s),
        ]
    return Group(*parts)


def _header(address: str, sample: Sample | None, interval: float) -> Text:
    """The address, the sample's time, the cluster's uptime (its controller's) and totals."""
    text = Text.assemble(("tqstream status ", "bold"), (address, "cyan"))
    if sample is not None:
        at = datetime.datetime.fromtimestamp(sample.time).strftime("%Y-%m-%d %H:%M:%S")
        s = sample.stats
        up = str(datetime.timedelta(seconds=int(s.uptime)))
        alive = sum(u.alive for u in s.units)
        text.append(
            f"  {at}  cluster up {up}  every {interval:g}s  |  "
            f"{_plural(len(s.partitions), 'partition')}, "
            f"{alive}/{len(s.units)} storage units alive, {_size(s.storage_bytes)}"
        )
    else:
        text.append(f"  every {interval:g}s  |  waiting for the first sample")
    return text


def _table(title: str, *columns: str, left: int = 1) -> Table:
    """A table whose first ``left`` columns are names (left-aligned) and the rest numbers."""
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
              pad_edge=False, show_edge=False)  # fmt: skip
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right", no_wrap=i < left)
    return t


def _empty(what: str) -> Text:
    return Text(what, style="dim")


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _fields(p: PartitionStats) -> str:
    """``name n/N`` per field (N: rows held), fields written for as many rows sharing one count:
    ``input_ids,rewards 64/64  advantages 32/64``."""
    by_count: dict[int, list[str]] = {}
    for f, n in p.fields.items():
        by_count.setdefault(n, []).append(f)
    return "  ".join(f"{','.join(fs)} {n}/{p.rows}" for n, fs in by_count.items()) or "-"


def _partitions(s: Stats, rates: Rates | None) -> RenderableType:
    if not s.partitions:
        return _empty("partitions: no partitions yet")
    t = _table("partitions", "partition", "rows", "produced", "put/s", "fields", "pending puts",
               "parked gets", "producers", "freed", "rejected", "stale", "expired",
               "lost")  # fmt: skip
    t.columns[4].justify = "left"
    for name, p in s.partitions.items():
        r = rates.partitions.get(name) if rates is not None else None
        producers = "closed" if p.producers_open == 0 else f"{p.producers_open} open"
        t.add_row(
            name, str(p.rows), str(p.produced), _rate(r.put_rows_per_s if r else None),
            _fields(p), str(p.pending_puts), str(p.parked_requests), producers, str(p.freed),
            str(p.rejected), str(p.stale_dropped), str(p.expired), str(p.lost),
        )  # fmt: skip
    return t


def _tasks(s: Stats, rates: Rates | None) -> RenderableType:
    t = _table("tasks", "partition", "task", "available", "leased", "acked", "consumed",
               "consume/s", "lag mean", "lag max", "stale", "lost", left=2)  # fmt: skip
    for name, p in s.partitions.items():
        r = rates.partitions.get(name) if rates is not None else None
        for task, ts in p.tasks.items():
            tr = r.tasks.get(task) if r is not None else None
            lag = lag_summary(ts)
            label = f"{task} (registered)" if task in p.tasks_registered else task
            t.add_row(
                name, label, str(ts.available), str(ts.leased), str(ts.acked),
                str(consumed(p, task, ts)), _rate(tr.consume_rows_per_s if tr else None),
                "-" if lag is None else f"{lag[0]:.2f}", "-" if lag is None else str(lag[1]),
                str(ts.stale_dropped), str(ts.lost),
            )  # fmt: skip
    return t if t.row_count else _empty("tasks: no consumer tasks yet")


def _units(s: Stats) -> RenderableType:
    if not s.units:
        return _empty("storage units: none registered")
    t = _table("storage units", "unit", "address", "state", "bytes", "rows", "chunks", "quota",
               "quota use", left=3)  # fmt: skip
    for i, u in enumerate(s.units):
        state = Text("alive", style="green") if u.alive else Text("LOST", style="bold red")
        quota, use = "unlimited", "-"
        if u.max_bytes:
            quota, use = _size(u.max_bytes), f"{100 * u.bytes / u.max_bytes:.1f}%"
        t.add_row(str(i), u.address, state, _size(u.bytes), str(u.rows), str(u.chunks), quota,
                  use)  # fmt: skip
    return t


def _admissions(s: Stats) -> RenderableType:
    if not s.admissions:
        return _empty("admissions: none")
    t = _table("admissions", "admission", "style", "version", "state", left=2)
    t.columns[3].justify = "left"
    for name, state in s.admissions.items():
        rest = "  ".join(f"{k} {v}" for k, v in state.items() if k not in ("style", "version"))
        t.add_row(name, str(state.get("style", "-")), str(state.get("version", "-")), rest)
    return t
