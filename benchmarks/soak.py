"""Soak run: producers and consumers stream through a process cluster for minutes while storage
units are SIGKILLed and restarted; every process's RSS is sampled.

    python -m benchmarks.soak --minutes 10 [--units 3 --replicas 2 --kill-every 60]

Checks, by content, that every row put was consumed exactly once by the training task (with
``--replicas 2`` no row may be lost; with 1 the lost rows are counted by the controller and must
match), and reports the memory of every process after warm-up and at the end. Writes a JSON
summary (``--out``). Not part of the test suite: it runs for minutes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

FIELDS = ("x", "pid")
ROWS_PER_PUT = 8
WIDTH = 256


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _produce(address: str, index: int, stop: Any, out: Any) -> None:
    import torch

    import tqstream

    retries = 0
    with tqstream.connect(address) as client:
        seq = 0
        while not stop.is_set():
            ids = torch.arange(seq, seq + ROWS_PER_PUT, dtype=torch.int64) + index * 10**9
            data = {"x": ids[:, None].to(torch.float64).repeat(1, WIDTH), "pid": ids}
            while True:
                try:
                    client.put(data, "soak", timeout=30)
                    break
                except (tqstream.UnitLostError, tqstream.ConnectionLostError):
                    retries += 1  # rolled back: nothing of it was kept; put it again
                    time.sleep(0.05)
            seq += ROWS_PER_PUT
            time.sleep(0.002)
        client.close_partition("soak")  # the last one closes it: readers get the short rest
    out.put(("producer", index, seq, retries))  # it put ids index * 1e9 + [0, seq)


def _consume(address: str, index: int, out: Any) -> None:
    """Reads until the partition is closed (by every producer) and drained."""
    import torch

    import tqstream

    seen: dict[int, bytearray] = {}  # producer -> times each of its rows was consumed
    errors = 0
    with tqstream.connect(address) as client:
        while True:
            try:
                batch = client.get("soak", list(FIELDS), 16, "train", timeout=5.0)
            except tqstream.PartitionDrainedError:
                break
            except tqstream.RequestTimeoutError:
                continue
            except tqstream.UnitLostError:
                errors += 1
                continue
            x, pid = batch.data["x"], batch.data["pid"]
            assert torch.equal(x, pid[:, None].to(torch.float64).repeat(1, WIDTH)), "corrupt row"
            for row in pid.tolist():
                counts = seen.setdefault(row // 10**9, bytearray())
                k = row % 10**9
                if k >= len(counts):
                    counts.extend(bytes(k + 1 - len(counts) + 4096))
                counts[k] = min(counts[k] + 1, 255)
            batch.ack()
    out.put(("consumer", index, seen, errors))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--units", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the RSS baseline")
    p.add_argument("--out", default="soak.json")
    args = p.parse_args(argv)

    import tqstream

    cluster = tqstream.ProcessCluster(args.units, replicas=args.replicas, lease_timeout=60)
    ctx = mp.get_context("spawn")
    halt, out = ctx.Event(), ctx.Queue()
    with tqstream.connect(cluster.address) as client:
        client.create_partition(
            "soak", list(FIELDS), tasks=["train"], replicas=args.replicas, producers=args.producers
        )
        procs = [
            ctx.Process(target=_produce, args=(cluster.address, i, halt, out), name=f"producer{i}")
            for i in range(args.producers)
        ] + [
            ctx.Process(target=_consume, args=(cluster.address, i, out), name=f"consumer{i}")
            for i in range(args.consumers)
        ]
        for proc in procs:
            proc.start()
        samples: list[dict[str, Any]] = []
        kills: list[dict[str, Any]] = []
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_kill = t0 + args.kill_every
        rng = random.Random(0)

        def sample() -> None:
            row: dict[str, Any] = {"t": round(time.monotonic() - t0, 1)}
            row["controller"] = _rss_mib(cluster.procs[0].pid)
            for i, unit in enumerate(cluster.procs[1:]):
                row[f"unit{i}"] = _rss_mib(unit.pid)
            for proc in procs:
                row[proc.name] = _rss_mib(proc.pid or 0)
            row["storage_bytes"] = client.stats().storage_bytes
            samples.append(row)

        while time.monotonic() < end:
            sample()
            if time.monotonic() >= next_kill:
                i = rng.randrange(args.units)
                victim = cluster.procs[1 + i]
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                time.sleep(2.0)
                cluster.restart_unit(i)
                kills.append({"t": round(time.monotonic() - t0, 1), "unit": i})
                next_kill += args.kill_every
            time.sleep(args.sample_every)
        halt.set()
        results: dict[str, list[Any]] = {"producer": [], "consumer": []}
        for _ in range(args.producers):  # a put may still be retried: wait for every one
            role, index, ids, count = out.get(timeout=300)
            results[role].append((index, ids, count))
        for _ in range(args.consumers):  # they end once the producers closed the partition
            role, index, ids, count = out.get(timeout=300)
            results[role].append((index, ids, count))
        for proc in procs:
            proc.join(30)
        stats = client.stats("soak").partitions["soak"]
        final_bytes = client.stats().storage_bytes
    cluster.close()

    rows_put = missing = duplicates = consumed = 0
    for index, n, _ in results["producer"]:
        rows_put += n
        for k in range(n):
            times = sum(
                seen[index][k] for _, seen, _ in results["consumer"]
                if index in seen and k < len(seen[index])
            )  # fmt: skip
            consumed += times
            missing += times == 0
            duplicates += max(0, times - 1)

    def growth(role: str) -> dict[str, float | None]:
        base = next((s for s in samples if s["t"] >= args.warmup), samples[0])
        values = [s[role] for s in samples if s["t"] >= args.warmup and s.get(role)]
        return {
            "after_warmup": base.get(role),
            "end": samples[-1].get(role),
            "max": max(values) if values else None,
        }

    roles = [k for k in samples[0] if k not in ("t", "storage_bytes")]
    summary = {
        "minutes": args.minutes,
        "units": args.units,
        "replicas": args.replicas,
        "producers": args.producers,
        "consumers": args.consumers,
        "kills": kills,
        "rows_put": rows_put,
        "rows_consumed": consumed,
        "rows_missing": missing,
        "duplicates": duplicates,
        "lost_counted": stats.lost,
        "rows_left": stats.rows,
        "pending_puts_left": stats.pending_puts,
        "task_left": {t: [v.available, v.leased] for t, v in stats.tasks.items()},
        "put_retries": sum(c for _, _, c in results["producer"]),
        "get_errors": sum(c for _, _, c in results["consumer"]),
        "storage_bytes_at_end": final_bytes,
        "rss_mib": {role: growth(role) for role in roles},
        "samples": samples,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    brief = {k: v for k, v in summary.items() if k != "samples"}
    print(json.dumps(brief, indent=1))
    ok = missing == stats.lost and duplicates == 0 and (args.replicas == 1 or not missing)
    return 0 if ok and final_bytes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
