"""small / mid / large / ragged: one batch put → get → ack/clear per round, every system."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks._bench import roundtrip
from benchmarks._systems import System
from benchmarks._workload import SCENARIOS


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_roundtrip(benchmark: Any, system: System, scenario: str) -> None:
    roundtrip(benchmark, system, SCENARIOS[scenario].sized(), group=scenario)
