"""What the scenario tests share: a measured round trip and its correctness check."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks._systems import Data, System, flatten
from benchmarks._workload import FIELDS, Batch, Scenario, make_batch


def check(batch: Batch, out: Data) -> None:
    """``out`` holds exactly the batch's values, row by row, in order."""
    for name in FIELDS:
        got, want = flatten(out[name]), flatten(batch.fields[name])
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name} came back different"


def aliases(batch: Batch, out: Data) -> bool:
    """Whether any returned tensor lies in the producer's own input memory (nothing was copied:
    the consumer reads what the producer may still overwrite)."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()

    inputs = [span(t) for v in batch.fields.values() for t in (v if isinstance(v, list) else [v])]
    for name in FIELDS:
        start, end = span(out[name].values() if out[name].is_nested else out[name])
        if any(start < hi and lo < end for lo, hi in inputs):
            return True
    return False


def roundtrip(benchmark: Any, system: System, scenario: Scenario, group: str) -> None:
    """Benchmark put → get → done of one batch; check the data once and that nothing is kept."""
    batch = make_batch(scenario.batch, scenario.length, ragged=scenario.ragged)
    case = f"B={scenario.batch} L={scenario.length}" + (" ragged" if scenario.ragged else "")
    benchmark.group = group
    benchmark.extra_info.update(
        system=system.name,
        mode=system.mode,
        note=system.note,
        case=case,
        bytes=batch.nbytes,
        batch=scenario.batch,
        length=scenario.length,
        layout="ragged" if scenario.ragged else "dense",
    )
    system.begin(f"{group}-{scenario.batch}x{scenario.length}")
    try:
        data = system.prepare(batch)
        out = system.roundtrip(data)
        check(batch, out)
        benchmark.extra_info["aliases_input"] = aliases(batch, out)
        del out
        benchmark.pedantic(
            system.roundtrip,
            args=(data,),
            rounds=scenario.rounds,
            warmup_rounds=scenario.warmup,
            iterations=1,
        )
        held = system.held()
        assert held in (None, 0), f"{system.name} still holds {held} after the rounds"
    finally:
        system.end()
