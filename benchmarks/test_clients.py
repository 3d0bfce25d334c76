"""many clients: thousands of connected clients, half of them parked on gets, while a few work.

A ``ProcessCluster`` (the controller and one storage unit in processes of their own). Two working
clients, each in a thread of this process, loop on a partition of their own: put 8 rows
(``float32 [256]``), get them, ack them; each round trip is timed. They run for a few seconds
alone, then again while ``CLIENTS`` other clients are connected: those live in ``HOSTS`` processes
(``_idle_clients.py``), one loop thread and one ZMQ context each, and half of them wait in a get
of a partition nobody writes (parked at the controller, each with its ZMQ heartbeats going).

- ``p50_ms`` / ``p99_ms`` (alone, loaded): the working clients' round trip; ``ratio_p99``: loaded
  over alone (the target: <= 2);
- ``connect_s``: the time to connect every client (the hosts side by side, each one client after
  the other: the slowest host's sum), and a client's connect ``connect_p50_ms`` /
  ``connect_p99_ms``;
- ``rss_per_client``: the controller's resident memory growth per connected client (bytes), the
  parked gets included; ``parked``: the gets the controller held, read from its stats;
- ``leave_s``: from the moment every client starts closing until the controller holds none of
  their gets (each cancelled, or dropped with its client).

Run ``python -m benchmarks.test_clients [CLIENTS]`` for the table (default 4096), or through
pytest-benchmark (``-k clients``; quick mode: 256 clients, one second per phase).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from benchmarks._workload import quick
from benchmarks.test_scale import rss

CLIENTS = 4096
HOSTS = 4
WORKERS = 2
ROWS = 8


class Worker(threading.Thread):
    """A client's put → get → ack of ``ROWS`` rows on a partition of its own, in a loop, timed."""

    def __init__(self, address: str, name: str) -> None:
        super().__init__(name=f"clients-{name}", daemon=True)
        import tqstream

        self.client = tqstream.connect(address)
        self.partition = name
        self.client.create_partition(name, ["y"], tasks=["t"])
        self.data = {"y": torch.zeros(ROWS, 256)}
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.client.put(self.data, self.partition)
            self.client.get(self.partition, ["y"], ROWS, "t", timeout=60).ack()
            self.times.append(time.perf_counter() - t0)


def work(address: str, seconds: float, tag: str) -> list[float]:
    """The round trips of ``WORKERS`` working clients over ``seconds``."""
    workers = [Worker(address, f"{tag}{i}") for i in range(WORKERS)]
    try:
        for w in workers:
            w.start()
        time.sleep(seconds)
    finally:
        for w in workers:
            w.stop.set()
        for w in workers:
            w.join()
            w.client.close()
    return [t for w in workers for t in w.times[1:]]  # each one's first: its connections open


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def measure(clients: int, seconds: float) -> dict[str, Any]:
    import tqstream

    with tqstream.ProcessCluster(storage_units=1) as cluster:
        pid = cluster.procs[0].pid
        admin = tqstream.connect(cluster.address)
        hosts: list[subprocess.Popen[str]] = []
        try:
            admin.create_partition("idle", ["x"], tasks=["t"])
            alone = work(cluster.address, seconds, "alone")
            before = rss(pid)
            per_host = [clients // HOSTS + (i < clients % HOSTS) for i in range(HOSTS)]
            command = [sys.executable, "-m", "benchmarks._idle_clients", cluster.address]
            hosts = [
                subprocess.Popen(
                    [*command, str(n), str(n // 2)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for n in per_host
            ]
            connect: list[float] = []
            connect_s = 0.0  # the hosts connect side by side, each one client after the other
            for h in hosts:
                assert h.stdout is not None
                line = h.stdout.readline()
                if not line:
                    raise RuntimeError(f"an idle-clients process ended early ({h.wait()})")
                times = json.loads(line)["connect"]
                connect += times
                connect_s = max(connect_s, sum(times))
            want = sum(n // 2 for n in per_host)
            deadline = time.monotonic() + 60
            while (parked := admin.stats("idle").partitions["idle"].parked_requests) < want:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{parked} of {want} gets parked after 60 s")
                time.sleep(0.1)
            grown = rss(pid) - before
            loaded = work(cluster.address, seconds, "loaded")
            t0 = time.perf_counter()
            for h in hosts:
                assert h.stdin is not None
                h.stdin.close()
            while admin.stats("idle").partitions["idle"].parked_requests:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("the parked gets outlived their clients by 120 s")
                time.sleep(0.01)
            leave_s = time.perf_counter() - t0
            return {
                "clients": clients,
                "parked": parked,
                "p50_ms": (statistics.median(alone) * 1e3, statistics.median(loaded) * 1e3),
                "p99_ms": (_quantile(alone, 0.99) * 1e3, _quantile(loaded, 0.99) * 1e3),
                "ratio_p99": _quantile(loaded, 0.99) / _quantile(alone, 0.99),
                "round_trips": (len(alone), len(loaded)),
                "connect_s": connect_s,
                "connect_p50_ms": statistics.median(connect) * 1e3,
                "connect_p99_ms": _quantile(connect, 0.99) * 1e3,
                "rss_per_client": grown / clients,
                "leave_s": leave_s,
            }
        finally:
            for h in hosts:
                if h.stdin is not None and not h.stdin.closed:
                    h.stdin.close()
            for h in hosts:
                h.wait(timeout=60)
            admin.close()


def test_many_clients(benchmark: Any) -> None:
    benchmark.group = "clients"
    clients, seconds = (256, 1.0) if quick() else (CLIENTS, 10.0)
    out: dict[str, Any] = {}

    def run() -> float:
        out.update(measure(clients, seconds))
        return float(out["ratio_p99"])

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(system="tqstream-procs", case=f"{clients} clients", **out)
    assert out["parked"] == clients // 2


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| clients (parked gets) | round trip p50, alone → loaded | p99, alone → loaded | "
        "p99 ratio | connect all (one client p50 / p99) | controller RSS / client | all leave |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        (a50, l50), (a99, l99) = r["p50_ms"], r["p99_ms"]
        lines.append(
            f"| {r['clients']:,} ({r['parked']:,}) | {a50:.1f} → {l50:.1f} ms | "
            f"{a99:.1f} → {l99:.1f} ms | {r['ratio_p99']:.2f}x | {r['connect_s']:.1f} s "
            f"({r['connect_p50_ms']:.1f} / {r['connect_p99_ms']:.1f} ms) | "
            f"{r['rss_per_client'] / 1024:.1f} KiB | {r['leave_s']:.2f} s |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    counts = [int(float(a)) for a in sys.argv[1:]] or [CLIENTS]
    print(table([measure(n, 10.0) for n in counts]))
