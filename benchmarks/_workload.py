"""The workload: batches of RL rollout rows and the size of each scenario.

A row has ``input_ids`` int64 [L], ``attention_mask`` bool [L], ``old_logprobs`` float32 [L],
``token_versions`` int32 [L] and a float32 scalar ``rewards``: 17 bytes per token plus 4 per row.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

__all__ = [
    "CONCURRENCY",
    "FIELDS",
    "METADATA_ROWS",
    "SCENARIOS",
    "SWEEP_BATCHES",
    "SWEEP_LENGTH",
    "Batch",
    "Concurrency",
    "Scenario",
    "make_batch",
    "quick",
    "row_ids",
]

FIELDS = ("input_ids", "attention_mask", "old_logprobs", "token_versions", "rewards")


def quick() -> bool:
    """Smallest sizes, one round, no warmup (``--bench-quick`` or ``TQSTREAM_BENCH_QUICK=1``)."""
    return os.environ.get("TQSTREAM_BENCH_QUICK", "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A put → get → free round trip of one batch."""

    name: str
    batch: int
    length: int
    ragged: bool = False
    rounds: int = 20
    warmup: int = 2

    def sized(self) -> Scenario:
        """This scenario as run now: tiny and one round in quick mode."""
        if not quick():
            return self
        return dataclasses.replace(self, batch=8, length=64, rounds=1, warmup=0)


@dataclasses.dataclass(frozen=True)
class Concurrency:
    """``producers`` threads put ``puts`` batches of ``rows`` rows; ``tasks`` consumer tasks each
    read every row once, ``rows`` at a time."""

    producers: int = 8
    puts: int = 16
    rows: int = 64
    length: int = 128
    tasks: int = 4
    rounds: int = 4
    warmup: int = 1

    @property
    def total(self) -> int:
        return self.producers * self.puts * self.rows

    def sized(self) -> Concurrency:
        if not quick():
            return self
        return dataclasses.replace(self, puts=2, rows=16, length=32, rounds=1, warmup=0)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("small", 64, 128, rounds=200, warmup=10),
        Scenario("mid", 256, 2048, rounds=20, warmup=2),
        Scenario("large", 1024, 4096, rounds=5, warmup=1),
        Scenario("ragged", 256, 2048, ragged=True, rounds=20, warmup=2),
    )
}
CONCURRENCY = Concurrency()
METADATA_ROWS = (10**3, 10**4, 10**5, 10**6)
SWEEP_BATCHES = (16, 64, 256, 1024)
SWEEP_LENGTH = 1024


@dataclasses.dataclass
class Batch:
    """``rows`` rows, each field either a dense ``[B, L]`` / ``[B]`` tensor or, when ragged, a
    list of B 1-D tensors; ``nbytes`` counts payload bytes only (no offsets, no padding)."""

    rows: int
    length: int
    ragged: bool
    fields: dict[str, torch.Tensor | list[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        total = 0
        for value in self.fields.values():
            parts = value if isinstance(value, list) else [value]
            total += sum(t.numel() * t.element_size() for t in parts)
        return total

    def flat(self) -> dict[str, torch.Tensor]:
        """Ragged fields as ``<name>`` (values back to back) and ``<name>.offsets`` (int64,
        B + 1): the natural form for a store of raw buffers. Dense batches are returned as is."""
        out: dict[str, torch.Tensor] = {}
        for name, value in self.fields.items():
            if isinstance(value, list):
                out[name] = torch.cat(value)
                lengths = torch.tensor([0] + [len(t) for t in value], dtype=torch.int64)
                out[f"{name}.offsets"] = lengths.cumsum(0)
            else:
                out[name] = value
        return out

    def jagged(self) -> dict[str, torch.Tensor]:
        """Ragged fields as jagged nested tensors sharing the flat values."""
        out: dict[str, torch.Tensor] = {}
        flat = self.flat()
        for name, value in self.fields.items():
            if isinstance(value, list):
                out[name] = torch.nested.nested_tensor_from_jagged(
                    flat[name], flat[f"{name}.offsets"]
                )
            else:
                out[name] = value
        return out


def make_batch(
    rows: int, length: int, *, ragged: bool = False, first_id: int = 0, seed: int = 0
) -> Batch:
    """A batch whose ``rewards`` carry row ids ``first_id, first_id + 1, ...`` (exact in float32
    up to 2**24), so a consumer can check it received each row exactly once."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (
        torch.randint(1, length + 1, (rows,), generator=gen).tolist() if ragged else [length] * rows
    )
    total = sum(lengths)
    flat = {
        "input_ids": torch.randint(0, 32000, (total,), generator=gen, dtype=torch.int64),
        "attention_mask": torch.rand(total, generator=gen) < 0.9,
        "old_logprobs": -torch.rand(total, generator=gen),
        "token_versions": torch.randint(0, 4, (total,), generator=gen, dtype=torch.int32),
    }
    fields: dict[str, torch.Tensor | list[torch.Tensor]] = {
        name: [r.clone() for r in torch.split(t, lengths)] if ragged else t.view(rows, length)
        for name, t in flat.items()
    }
    fields["rewards"] = torch.arange(first_id, first_id + rows, dtype=torch.float32)
    return Batch(rows, length, ragged, fields)


def row_ids(data: Mapping[str, torch.Tensor]) -> list[int]:
    """The row ids carried by ``rewards``."""
    return [int(x) for x in data["rewards"].tolist()]
