"""replicas: what a second copy of every row costs a small put.

A ``ProcessCluster`` with two storage units; one client puts small batches (``SHAPES``: one
~1k-token trajectory, and 64 rows of 128 tokens) to three partitions in turn, in blocks so that a
drift of the machine hits all alike:

- ``one copy``: ``replicas=1``, the one-exchange put (to a unit, which has the controller commit);
- ``two copies``: ``replicas=2``, the same rows to both units at once, each has the controller
  commit them and it commits once both hold them (one exchange per unit, in parallel);
- ``two copies, placed``: ``replicas=2`` with every put placed by the controller first (prepare →
  store on both units → commit: how a replicated put went before it had the paired path).

Reported: the median put time of each and its ratio to ``one copy``; and the rate of
``IN_FLIGHT`` concurrent ``async_put`` calls of one trajectory each (how rollout workers put, see
``test_producers``' agent scenario) in rows/s, median of 5, and its ratio. Run
``python -m benchmarks.test_replicas [ROUNDS]`` for the table, or through pytest-benchmark
(``-k replicas``; quick mode: fewer rounds).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

import pytest
import torch

from benchmarks._workload import quick

SHAPES = {"trajectory": (1, 1024), "64 rows": (64, 128)}
BLOCK = 50
IN_FLIGHT = 256
CASES = ("one copy", "two copies", "two copies, placed")


def measure(rounds: int | None = None) -> list[dict[str, Any]]:
    import tqstream
    from tqstream import ClientConfig

    rounds = rounds or (100 if quick() else 1000)
    out = []
    with tqstream.ProcessCluster(storage_units=2) as cluster:
        direct = tqstream.connect(cluster.address)
        placed = tqstream.connect(cluster.address, ClientConfig(direct_put_bytes=0))
        try:
            for shape, (rows, tokens) in SHAPES.items():
                data = {
                    "input_ids": torch.randint(0, 50_000, (rows, tokens)),
                    "logprobs": torch.randn(rows, tokens),
                }
                for case in CASES:
                    direct.create_partition(f"{shape}/{case}", list(data),
                                            replicas=1 if case == CASES[0] else 2)  # fmt: skip
                clients = {CASES[0]: direct, CASES[1]: direct, CASES[2]: placed}
                times: dict[str, list[float]] = {case: [] for case in CASES}
                for case, client in clients.items():  # warm up, and learn the partition's path
                    for _ in range(5):
                        client.put(data, f"{shape}/{case}")
                for _ in range(max(1, rounds // BLOCK)):
                    for case, client in clients.items():
                        for _ in range(BLOCK):
                            t0 = time.perf_counter()
                            client.put(data, f"{shape}/{case}")
                            times[case].append(time.perf_counter() - t0)
                        direct.clear_partition(f"{shape}/{case}")
                        direct.create_partition(f"{shape}/{case}", list(data),
                                                replicas=1 if case == CASES[0] else 2)  # fmt: skip
                rates = {}
                if shape == "trajectory":
                    for case, client in clients.items():
                        rates[case] = _in_flight(client, f"{shape}/{case}", rows, tokens)
                base = statistics.median(times[CASES[0]])
                for case in CASES:
                    median = statistics.median(times[case])
                    out.append({
                        "shape": shape,
                        "case": case,
                        "put_us": median * 1e6,
                        "p90_us": statistics.quantiles(times[case], n=10)[-1] * 1e6,
                        "ratio": median / base,
                        "rows_per_s": rates.get(case, 0.0),
                        "rate_ratio": rates[case] / rates[CASES[0]] if rates else 0.0,
                    })  # fmt: skip
        finally:
            direct.close()
            placed.close()
    return out


def _in_flight(client: Any, partition: str, rows: int, tokens: int) -> float:
    """Rows/s of ``IN_FLIGHT`` concurrent ``async_put`` calls of ``rows`` rows (median of 5)."""
    data = {
        "input_ids": torch.randint(0, 50_000, (rows, tokens)),
        "logprobs": torch.randn(rows, tokens),
    }

    async def main() -> list[float]:
        rates = []
        for _ in range(5):
            t0 = time.perf_counter()
            await asyncio.gather(*(client.async_put(data, partition) for _ in range(IN_FLIGHT)))
            rates.append(IN_FLIGHT * rows / (time.perf_counter() - t0))
        return rates

    return statistics.median(asyncio.run(main()))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| put | copies | median (p90) | / one copy | {IN_FLIGHT} in flight | / one copy |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = f"{r['rows_per_s']:,.0f} rows/s | {r['rate_ratio']:.2f}x" if r["rows_per_s"] else "|"
        lines.append(
            f"| {r['shape']} | {r['case']} | {r['put_us']:.0f} µs ({r['p90_us']:.0f}) | "
            f"{r['ratio']:.2f}x | {rate} |"
        )
    return "\n".join(lines)


@pytest.mark.benchmark(group="replicas")
def test_replicas(benchmark: Any) -> None:
    out: list[dict[str, Any]] = []

    def run() -> float:
        out[:] = measure()
        return float(out[1]["ratio"])

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(system="tqstream-procs", case="replicas", rows=out)


if __name__ == "__main__":
    print(table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else None)))
