"""sweep: round-trip throughput vs batch size B at L=1024 (run with ``--bench-sweep``)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks._bench import roundtrip
from benchmarks._systems import NAMED_ONLY, SYSTEMS, System
from benchmarks._workload import SWEEP_BATCHES, SWEEP_LENGTH, Scenario

BENCH_SYSTEMS = tuple(s for s in SYSTEMS if s not in ("ray-actor-queue", *NAMED_ONLY))


@pytest.mark.parametrize("batch", SWEEP_BATCHES)
def test_sweep(benchmark: Any, system: System, batch: int) -> None:
    rounds = max(10, min(50, 2000 // batch))
    scenario = Scenario("sweep", batch, SWEEP_LENGTH, rounds=rounds, warmup=2)
    roundtrip(benchmark, system, scenario.sized(), group="sweep")
