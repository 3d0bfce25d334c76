"""scale: the controller holding many rows, measured through the public API.

A ``ProcessCluster`` (the controller and one storage unit in processes of their own); one partition
with a registered task, filled with N rows of one field (``int8 [1]``) in puts of at most 2**20
rows (the largest a put may be). For each N:

- ``rss_per_row``: the controller's resident memory growth per held row (``/proc/<pid>/status``);
  ``rss_per_row_task``: the same once the registered task has read (its view of the rows exists);
- ``put_s``: the wall time of the largest put (``min(N, 2**20)`` rows, one request, which the
  controller plans and commits in one step of its loop);
- ``worst_wait_ms``: the longest put → get → ack of one row that another client (in a process
  of its own), looping on another partition, waited during that put (and ``alone_ms``, its
  median with nothing else going on): how long one big request holds up everybody else;
- ``first_get_ms`` (the timed figure): the first get of 64 rows by a task new to the partition;
- ``clear_s``: ``clear_partition`` of the N rows.

Run ``python -m benchmarks.test_scale [N ...]`` for the table (default 1e5 1e6; 1e7 needs ~6 GiB
for the controller), or through pytest-benchmark (``-k scale``; quick mode: 1e5 only).
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks._workload import quick

HELD = (100_000, 1_000_000)
MAX_PUT = 1 << 20


def rss(pid: int) -> int:
    """Resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _probe(address: str, pipe: Any) -> None:
    """Another client, in a process of its own: a put → get → ack of one row, in a loop, each
    timed (start, seconds) until the parent says stop; first the median of 50 with nothing else
    going on."""
    import tqstream

    client = tqstream.connect(address)
    client.create_partition("probe", ["y"], tasks=["t"])
    row = {"y": torch.zeros(1, 4)}

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        client.put(row, "probe")
        client.get("probe", ["y"], 1, "t", timeout=600).ack()
        return time.time(), time.perf_counter() - t0

    pipe.send(statistics.median(once()[1] for _ in range(50)))
    pipe.recv()
    times = []
    while not pipe.poll():
        times.append(once())
    pipe.recv()
    pipe.send(times)
    client.close()


class Prober:
    """The other client's process (:func:`_probe`): ``alone``, then the rounds that overlapped a
    span of time."""

    def __init__(self, address: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_probe, args=(address, child), daemon=True)
        self.proc.start()
        self.alone: float = self.pipe.recv()

    def start(self) -> None:
        self.pipe.send("go")

    def stop(self, since: float) -> list[float]:
        """The rounds that ended after wall time ``since``."""
        self.pipe.send("stop")
        times = self.pipe.recv()
        self.proc.join(30)
        return [t for end, t in times if end >= since]

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()


def measure(held: int) -> dict[str, Any]:
    import tqstream

    with tqstream.ProcessCluster(storage_units=1) as cluster:
        pid = cluster.procs[0].pid
        client = tqstream.connect(cluster.address)
        prober = Prober(cluster.address)
        try:
            client.create_partition("big", ["x"], tasks=["t"])
            before = rss(pid)
            sizes = [MAX_PUT] * (held // MAX_PUT) + ([held % MAX_PUT] if held % MAX_PUT else [])
            largest = max(sizes)
            put_s, waits = 0.0, []
            for i, n in enumerate(sorted(sizes)):  # the largest last, with the prober running
                data = {"x": torch.zeros(n, 1, dtype=torch.int8)}
                last = i == len(sizes) - 1
                if last:
                    prober.start()
                    time.sleep(0.5)
                    since = time.time()
                t0 = time.perf_counter()
                client.put(data, "big")
                if last:
                    put_s = time.perf_counter() - t0
                    time.sleep(0.2)
                    waits = prober.stop(since)
            after = rss(pid)
            client.get("big", ["x"], 64, "t", timeout=600).ack()  # the task's view is built
            with_task = rss(pid)
            t0 = time.perf_counter()
            client.get("big", ["x"], 64, "new", timeout=600)
            first_get = time.perf_counter() - t0
            t0 = time.perf_counter()
            client.clear_partition("big")
            clear_s = time.perf_counter() - t0
            return {
                "held": held,
                "rss_per_row": (after - before) / held,
                "rss_per_row_task": (with_task - before) / held,
                "put_rows": largest,
                "put_s": put_s,
                "worst_wait_ms": max(waits) * 1e3,
                "alone_ms": prober.alone * 1e3,
                "first_get_ms": first_get * 1e3,
                "clear_s": clear_s,
            }
        finally:
            prober.close()
            client.close()


@pytest.mark.parametrize("held", HELD[:1] if quick() else HELD)
def test_scale(benchmark: Any, held: int) -> None:
    benchmark.group = "scale"
    out: dict[str, Any] = {}

    def run() -> float:
        out.update(measure(held))
        return float(out["first_get_ms"])

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(system="tqstream-procs", case=f"N={held:.0e} rows held", **out)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| rows held | controller RSS / row (with one task's view) | largest put | its wall time "
        "| worst wait of another client (alone) | first get of a new task | clear |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['held']:.0e} | {r['rss_per_row']:.0f} B ({r['rss_per_row_task']:.0f} B) | "
            f"{r['put_rows']:,} rows | "
            f"{r['put_s']:.2f} s | {r['worst_wait_ms']:.0f} ms ({r['alone_ms']:.1f} ms) | "
            f"{r['first_get_ms']:.0f} ms | {r['clear_s']:.2f} s |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sizes = [int(float(a)) for a in sys.argv[1:]] or list(HELD)
    print(table([measure(n) for n in sizes]))
