"""durability: what the controller's journal costs and how fast a killed controller is back.

- ``durability-small`` / ``durability-large``: the small and large round trips (one batch put →
  get → ack per round) through ``tqstream-launch`` with ``--durability off``, ``batched`` and
  ``sync`` side by side (the producers scenarios, agent loop included, run the same three
  systems: ``test_producers.py``).
- ``recovery``: a controller holding ``ROWS`` rows (10⁶; 4096 a put, one task, the journal on
  this machine's disk, a snapshot every ``snapshot_records``) is SIGKILLed and started again by
  ``ProcessCluster.restart_controller``; a round is the time from the kill until a client's
  ``stats()`` is answered by the new process (its start, the replay, the units reconnected), and
  the journal's bytes per row held go into ``extra_info``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks._bench import roundtrip
from benchmarks._systems import System
from benchmarks._workload import SCENARIOS, quick

BENCH_SYSTEMS = ("tqstream-launch", "tqstream-launch-batched", "tqstream-launch-sync")
ROWS = 10_000 if quick() else 1_000_000
PER_PUT = 4096


@pytest.mark.parametrize("scenario", ["small", "large"])
def test_durability_roundtrip(benchmark: Any, system: System, scenario: str) -> None:
    roundtrip(benchmark, system, SCENARIOS[scenario].sized(), group=f"durability-{scenario}")


def _journal_bytes(directory: str) -> int:
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


@pytest.mark.parametrize("records", [20_000, 200_000])
def test_recovery(benchmark: Any, records: int) -> None:
    import tqstream
    from tqstream.launch.processes import ProcessCluster

    journal = tempfile.mkdtemp(prefix="tqstream-bench-journal-")
    cluster = ProcessCluster(
        1, durability="batched", journal=journal, snapshot_records=records, log_level="ERROR"
    )
    config = tqstream.ClientConfig(reconnect_timeout=120.0)
    try:
        with tqstream.connect(cluster.address, config) as client:
            client.create_partition("held", ["x"], tasks=["t"])
            x = torch.zeros(PER_PUT, 1, dtype=torch.int32)
            for _ in range(ROWS // PER_PUT):
                client.put({"x": x}, "held")
            held = client.stats("held").partitions["held"].rows
            journal_bytes = _journal_bytes(journal)

            def kill_and_wait() -> None:
                cluster.procs[0].kill()
                cluster.procs[0].wait()
                cluster.restart_controller()
                stats = client.stats("held")  # answered by the new process
                assert stats.partitions["held"].rows == held

            benchmark.group = "recovery"
            benchmark.pedantic(kill_and_wait, rounds=3, iterations=1)
            benchmark.extra_info.update(
                system="tqstream-launch-batched",
                case=f"{held:,} rows held, puts of {PER_PUT}, one task",
                rows=held,
                snapshot_records=records,
                journal_bytes=journal_bytes,
                journal_bytes_per_row=round(journal_bytes / max(held, 1), 2),
                unit="seconds from the controller's SIGKILL to its first answer",
                cpus=os.cpu_count(),
            )
    finally:
        cluster.close()
        shutil.rmtree(journal, ignore_errors=True)
