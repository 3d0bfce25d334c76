"""multi-host: producers on two hosts, the consumer on a third, over links shaped to a rate.

A rig (``tqstream.testing.rig``): three hosts (network namespaces, each with its own /dev/shm) on a
bridge whose links are shaped by ``tc tbf`` (``RATE``, 10 Gbit/s by default); the controller and a
storage unit on host 1, a unit on hosts 2 and 3 (``RigCluster``: CURVE keys on every socket).
A producer process on host 2 and one on host 3 each put ``ROWS`` rows (``float32 [WIDTH]``, 64 KiB:
a ~16k-token trajectory's per-token fields) ``PER_PUT`` at a time; the consumer on host 1 reads
them in batches of 64 and acks them. Once with ``ClientConfig(locality="host")`` (the default: a
producer's rows go to its own host's unit, one copy through shared memory), once with ``"off"``
(the units in turn, so two thirds of the puts cross to another host).

- ``rows_per_s``: rows over the time from the producers' start to the consumer's last ack;
- ``put_s``: the producers' own time (the slower one);
- ``crossing_mb``: bytes that crossed between hosts, from the units' counters (stored by a writer
  elsewhere + read by a reader elsewhere); ``local_mb``: stored by a writer on the unit's host.

Run ``python -m benchmarks.test_multihost [RATE]`` for the table, or through pytest-benchmark
(``-k multihost``; quick mode: fewer rows). Skipped where the rig cannot be built (root, ``ip``,
``tc``, ``unshare``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks._workload import quick

WIDTH = 16_384
PER_PUT = 4
RATE = "10gbit"


def measure(rate: str = RATE, rows: int | None = None) -> list[dict[str, Any]]:
    import tqstream
    from tqstream import ClientConfig
    from tqstream.testing.rig import Rig, RigCluster

    rows = rows or (64 if quick() else 1024)
    out = []
    with tempfile.TemporaryDirectory() as tmp, Rig(hosts=3, rate=rate) as rig:
        cluster = RigCluster(rig, str(Path(tmp) / "cluster.keys"))
        try:
            with tqstream.connect(cluster.address, ClientConfig(keys=cluster.keys)) as admin:
                for locality in ("host", "off"):
                    partition = f"multihost-{locality}"
                    admin.create_partition(partition, ["id", "x"], tasks=["t"])
                    before = admin.stats().units
                    t0 = time.perf_counter()
                    args = (rows, PER_PUT, WIDTH, locality)
                    producers = [
                        cluster.start(h, "produce", partition, h * 1_000_000, *args) for h in (2, 3)
                    ]
                    consumed = cluster.run(1, "consume", partition, 2 * rows, 64)
                    wall = time.perf_counter() - t0
                    made = [p.communicate(timeout=600)[0] for p in producers]
                    after = admin.stats().units
                    if len(consumed["ids"]) != 2 * rows or len(set(consumed["ids"])) != 2 * rows:
                        raise AssertionError("rows lost or read twice")
                    pairs = list(zip(after, before, strict=True))

                    def delta(key: str, pairs: list[Any] = pairs) -> int:
                        return sum(getattr(a, key) - getattr(b, key) for a, b in pairs)

                    out.append({
                        "locality": locality,
                        "rate": rate,
                        "rows": 2 * rows,
                        "rows_per_s": 2 * rows / wall,
                        "put_s": max(json.loads(m)["seconds"] for m in made),
                        "crossing_mb": (delta("remote_bytes") + delta("remote_read_bytes")) / 1e6,
                        "local_mb": delta("local_bytes") / 1e6,
                    })  # fmt: skip
                    admin.clear_partition(partition)
        finally:
            cluster.close()
    return out


def _unavailable() -> str:
    from tqstream.testing.rig import unavailable

    return unavailable()


@pytest.mark.skipif(bool(_unavailable()), reason="needs a multi-host rig (root, ip, tc, unshare)")
def test_multihost(benchmark: Any) -> None:
    benchmark.group = "multihost"
    out: list[dict[str, Any]] = []

    def run() -> float:
        out[:] = measure()
        return float(out[0]["rows_per_s"])

    benchmark.pedantic(run, rounds=1, iterations=1)
    for r in out:
        benchmark.extra_info[f"locality_{r['locality']}"] = r


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| locality | link | rows | rows/s | producers' put time | bytes crossing hosts | "
        "stored from the unit's own host |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['locality']} | {r['rate']} | {r['rows']:,} | {r['rows_per_s']:,.0f} | "
            f"{r['put_s']:.2f} s | {r['crossing_mb']:,.0f} MB | {r['local_mb']:,.0f} MB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure(sys.argv[1] if len(sys.argv) > 1 else RATE)))
