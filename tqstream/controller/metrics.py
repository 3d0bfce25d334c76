"""The controller's Prometheus endpoint (``metrics_port``): ``http://HOST:PORT/metrics``.

Almost everything is read at scrape time from what ``stats()`` already reports (the state's
counters, the storage units' byte counts, the admissions): the data path pays nothing for it. The
only numbers kept on the hot path are the request latencies and error counts, as plain bucket
counters in the loop's thread (one ``perf_counter`` and one ``bisect`` per request), turned into
histograms when scraped. A scrape runs on prometheus-client's HTTP thread and asks the serving
loop for one consistent sample, so it never reads the state while a request changes it.

docs/observability.md lists every metric.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.utils import floatToGoString

from tqstream.controller.state import ControllerState
from tqstream.errors import error_class
from tqstream.protocol.messages import ErrorReply
from tqstream.protocol.server import Server
from tqstream.types import Stats

__all__ = ["LAG_BUCKETS", "LATENCY_BUCKETS", "Metrics", "Sample"]

_log = logging.getLogger("tqstream.metrics")

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Upper bounds (seconds) of ``tqstream_request_duration_seconds``; +Inf is added."""
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
"""Upper bounds (policy versions) of ``tqstream_consumed_version_lag``; +Inf is added."""

# admission state keys that only grow: exported as counters, the rest as gauges
_ADMISSION_COUNTERS = frozenset(
    {
        "granted",
        "accepted",
        "rejected",
        "enqueued",
        "dropped",
        "resets",
        "unmatched",
        "clamped",
        "left",
        "returned",
    }
)


class _Latency:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0


class Sample:
    """What one scrape exports, taken on the serving loop in one step."""

    def __init__(
        self,
        stats: Stats,
        state: ControllerState,
        server: Server,
        drop_failures: int,
        metrics: Metrics,
        journal: Any = None,
    ) -> None:
        self.stats = stats
        self.journal = None if journal is None else journal.stats()  # JournalStats
        self.latency = {op: (list(h.counts), h.sum) for op, h in metrics.latency.items()}
        self.errors = dict(metrics.errors)
        self.parked_puts: dict[str, int] = {}
        for _, put in state.puts.waiting():
            self.parked_puts[put.req.partition] = self.parked_puts.get(put.req.partition, 0) + 1
        self.parked_acquires: dict[str, int] = {}
        for _, acquire in state.admissions.waiting():
            name = acquire.req.name
            self.parked_acquires[name] = self.parked_acquires.get(name, 0) + 1
        self.sessions = server.sessions
        self.drop_failures = drop_failures


class Metrics:
    """A prometheus-client collector and its HTTP server. ``sample`` (a coroutine function run on
    the serving loop) takes what a scrape exports; ``timeout``: seconds a scrape waits for it."""

    def __init__(
        self,
        host: str,
        port: int,
        sample: Callable[[], Coroutine[Any, Any, Sample]],
        timeout: float,
    ) -> None:
        self.sample, self.timeout = sample, timeout
        self.latency: dict[str, _Latency] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = time.time()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # type: ignore[arg-type]
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"the controller cannot serve metrics at http://{host}:{port}/metrics: "
                f"{exc.strerror}; pick another metrics_port (--metrics-port)",
            ) from exc
        self._thread.name = "tqstream-metrics"
        self.address = f"http://{host}:{self._httpd.server_port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (waits for the HTTP thread's next poll, <= 0.5 s)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the serving loop while the HTTP thread stops."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def stop() -> None:
            try:
                self.close()
            finally:
                loop.call_soon_threadsafe(done.set_result, None)

        try:
            threading.Thread(target=stop, name="tqstream-metrics-stop", daemon=True).start()
        except RuntimeError:  # no new threads at interpreter shutdown: block instead
            self.close()
            return
        await done

    # --- hot path (the serving loop's thread) ---
    def observe(self, op: str, started: float, reply: Any) -> None:
        """One request answered (``started``: its ``perf_counter`` at arrival)."""
        seconds = time.perf_counter() - started
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = _Latency()
        h.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        h.sum += seconds
        if reply.__class__ is ErrorReply:
            key = (op, reply.code)
            self.errors[key] = self.errors.get(key, 0) + 1

    # --- scrape (prometheus-client's HTTP thread) ---
    def collect(self) -> Iterator[Metric]:
        loop = self.loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the controller is not serving")
        future = asyncio.run_coroutine_threadsafe(self.sample(), loop)
        try:
            sample = future.result(self.timeout)
        except BaseException:
            future.cancel()
            _log.warning("a metrics scrape could not sample the controller", exc_info=True)
            raise
        yield from _families(sample, self.started)


def _families(s: Sample, started: float) -> Iterator[Metric]:
    stats = s.stats
    fam: Any
    hist: Any
    yield GaugeMetricFamily(
        "tqstream_start_time_seconds",
        "Unix time the controller started serving metrics.",
        value=started,
    )
    yield GaugeMetricFamily(
        "tqstream_connected_peers",
        "Clients (one per Client, whatever its threads) and storage units connected to the "
        "controller over TCP; in-process ones are not counted.",
        value=s.sessions,
    )
    yield CounterMetricFamily(
        "tqstream_storage_drop_failures",
        "Orders to free storage that a storage unit failed or did not answer.",
        value=s.drop_failures,
    )

    # --- partitions ---
    p_counters = {
        "produced": "Rows committed to the partition.",
        "rejected": "Rows refused at put (reject_mixed_versions).",
        "stale_dropped": "Rows evicted as stale (on_stale='drop').",
        "expired": "Rows evicted by the partition's ttl.",
        "freed": "Rows freed once every registered task acked them.",
        "lost": "Rows lost with a storage unit that held their only copy.",
    }
    for key, doc in p_counters.items():
        fam = CounterMetricFamily(f"tqstream_rows_{key}", doc, labels=["partition"])
        for name, p in stats.partitions.items():
            fam.add_metric([name], getattr(p, key))
        yield fam
    p_gauges = {
        "rows": ("tqstream_partition_rows", "Rows held (committed, not yet freed)."),
        "pending_puts": ("tqstream_partition_pending_puts", "Puts prepared, not committed."),
        "parked_requests": ("tqstream_parked_gets", "get_meta requests waiting for rows."),
        "producers_open": (
            "tqstream_partition_producers_open",
            "Producers that have not closed the partition (0: closed).",
        ),
        "replicas": ("tqstream_partition_replicas", "Copies kept of each row."),
    }
    for key, (metric, doc) in p_gauges.items():
        fam = GaugeMetricFamily(metric, doc, labels=["partition"])
        for name, p in stats.partitions.items():
            fam.add_metric([name], getattr(p, key))
        yield fam
    fam = GaugeMetricFamily(
        "tqstream_field_rows_written",
        "Rows of the partition that have the field written.",
        labels=["partition", "field"],
    )
    for name, p in stats.partitions.items():
        for field, n in p.fields.items():
            fam.add_metric([name, field], n)
    yield fam
    yield _labelled(
        GaugeMetricFamily(
            "tqstream_parked_puts",
            "Puts waiting for storage room (a unit quota).",
            labels=["partition"],
        ),
        s.parked_puts,
    )
    yield _labelled(
        GaugeMetricFamily(
            "tqstream_parked_acquires",
            "Admission acquires waiting for a slot.",
            labels=["admission"],
        ),
        s.parked_acquires,
    )

    # --- tasks ---
    t_metrics = (
        ("tqstream_rows_consumed", CounterMetricFamily, "consumed", "Rows the task acked."),
        ("tqstream_task_rows_acked", GaugeMetricFamily, "acked",
         "Rows the task acked that are still held (not yet freed)."),
        ("tqstream_task_rows_available", GaugeMetricFamily, "available",
         "Rows ready for the task: committed, not leased, not acked."),
        ("tqstream_task_rows_leased", GaugeMetricFamily, "leased",
         "Rows leased to the task, not yet acked."),
        ("tqstream_task_rows_stale_dropped", CounterMetricFamily, "stale_dropped",
         "Rows evicted as stale before the task consumed them."),
        ("tqstream_task_rows_lost", CounterMetricFamily, "lost",
         "Rows lost with a storage unit before the task acked them."),
        ("tqstream_task_tokens_masked", CounterMetricFamily, "tokens_masked",
         "Generated tokens of acked rows outside a token-measure window (masked, not trained on)."),
    )  # fmt: skip
    for metric, kind, key, doc in t_metrics:
        fam = kind(metric, doc, labels=["partition", "task"])
        for name, p in stats.partitions.items():
            for task, t in p.tasks.items():
                fam.add_metric([name, task], getattr(t, key))
        yield fam
    hist = HistogramMetricFamily(
        "tqstream_consumed_version_lag",
        "Policy versions between a row's generation and the version that consumed (acked) it.",
        labels=["partition", "task"],
    )
    for name, p in stats.partitions.items():
        for task, t in p.tasks.items():
            buckets, total = _cumulative(LAG_BUCKETS, t.lag)
            hist.add_metric([name, task], buckets, float(total))
    yield hist

    # --- storage units ---
    u_metrics = (
        ("tqstream_unit_up", "alive", "1 while the storage unit is reachable, 0 once lost."),
        ("tqstream_unit_bytes", "bytes", "Bytes of row data held (-1: did not answer)."),
        ("tqstream_unit_rows", "rows", "Rows held (a row's copy counts on each unit)."),
        ("tqstream_unit_chunks", "chunks", "Chunks (one put's rows of a field set) held."),
        ("tqstream_unit_max_bytes", "max_bytes", "Byte quota (0: unlimited)."),
        ("tqstream_unit_spare_bytes", "spare_bytes",
         "Recycled shared-memory segments kept for reuse (not in bytes)."),
    )  # fmt: skip
    for metric, key, doc in u_metrics:
        fam = GaugeMetricFamily(metric, doc, labels=["unit", "address"])
        for i, u in enumerate(stats.units):
            fam.add_metric([str(i), u.address], float(getattr(u, key)))
        yield fam
    stored = CounterMetricFamily(
        "tqstream_unit_stored_bytes",
        "Bytes stored since the unit started, by where the writer was: local (on the unit's host) "
        "or remote (another host: over the network).",
        labels=["unit", "address", "origin"],
    )
    read = CounterMetricFamily(
        "tqstream_unit_read_bytes",
        "Bytes read since the unit started, by where the reader was: local (on the unit's host) "
        "or remote (another host: over the network).",
        labels=["unit", "address", "origin"],
    )
    for i, u in enumerate(stats.units):
        stored.add_metric([str(i), u.address, "local"], float(u.local_bytes))
        stored.add_metric([str(i), u.address, "remote"], float(u.remote_bytes))
        read.add_metric([str(i), u.address, "local"], float(u.local_read_bytes))
        read.add_metric([str(i), u.address, "remote"], float(u.remote_read_bytes))
    yield stored
    yield read

    # --- admissions ---
    families: dict[str, Any] = {}
    for name, state in stats.admissions.items():
        style = str(state.get("style", ""))
        for key, value in state.items():
            if isinstance(value, str):
                continue
            if style == "budget" and key == "enqueued":
                key = "waiting"  # a budget's enqueued inputs go up and down: a gauge of its own
            counter = key in _ADMISSION_COUNTERS
            metric = f"tqstream_admission_{key}"
            fam = families.get(metric)
            if fam is None:
                kind = CounterMetricFamily if counter else GaugeMetricFamily
                doc = f"Admission controller state: {key} (docs/observability.md)."
                fam = families[metric] = kind(metric, doc, labels=["admission", "style"])
            fam.add_metric([name, style], float(value))
    yield from families.values()

    # --- requests ---
    hist = HistogramMetricFamily(
        "tqstream_request_duration_seconds",
        "Seconds from a request's arrival at the controller to its answer (a parked get_meta or "
        "acquire includes its wait).",
        labels=["operation"],
    )
    for op, (counts, total) in sorted(s.latency.items()):
        buckets, _ = _cumulative(LATENCY_BUCKETS, counts)
        hist.add_metric([op], buckets, total)
    yield hist
    fam = CounterMetricFamily(
        "tqstream_request_errors",
        "Requests answered with an error, by operation and exception class.",
        labels=["operation", "error"],
    )
    for (op, code), n in sorted(s.errors.items()):
        fam.add_metric([op, error_class(code).__name__], n)
    yield fam
    if s.journal is not None:
        yield from _journal(s.journal)


def _journal(j: Any) -> Iterator[Metric]:
    """The journal's families (a controller with ``durability`` other than ``off``)."""
    yield GaugeMetricFamily(
        "tqstream_journal_degraded",
        "1 while the journal cannot be written (disk full, an I/O error): replies are not durable "
        "until a snapshot makes it whole again; 0 when it is.",
        value=int(bool(j.degraded)),
    )
    for name, doc, value in (
        ("records", "Records appended to the journal since the controller started.", j.records),
        ("bytes", "Bytes written to the journal since the controller started.", j.bytes),
        ("writes", "Batches written to the journal (one write each).", j.writes),
        ("fsyncs", "Fsyncs of the journal.", j.fsyncs),
        ("lost_records", "Records the journal failed to write (degraded).", j.lost),
        ("snapshots", "Snapshots written (each starts a fresh journal).", j.rebases),
    ):
        yield CounterMetricFamily(f"tqstream_journal_{name}", doc, value=value)
    yield GaugeMetricFamily(
        "tqstream_journal_replay_bytes",
        "Bytes of journal after the newest snapshot: what a restart replays.",
        value=j.journal_bytes,
    )


def _labelled(fam: GaugeMetricFamily, values: dict[str, int]) -> GaugeMetricFamily:
    for label, v in sorted(values.items()):
        fam.add_metric([label], v)
    return fam


def _cumulative(
    bounds: tuple[float, ...], counts: dict[int, int] | list[int]
) -> tuple[list[tuple[str, float]], float]:
    """Prometheus buckets (cumulative, +Inf last) and the sum of the observed values.

    ``counts``: a list of per-bucket counts (one more than ``bounds``), or a dict of exact
    value -> count (then the sum is exact too)."""
    if isinstance(counts, list):
        per, total = counts, 0.0
    else:
        per = [0] * (len(bounds) + 1)
        total = 0.0
        for value, n in counts.items():
            per[bisect.bisect_left(bounds, value)] += n
            total += value * n
    out, running = [], 0
    for bound, n in zip([*bounds, float("inf")], per, strict=True):
        running += n
        out.append((floatToGoString(bound), float(running)))
    return out, total
