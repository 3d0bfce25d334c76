"""The workload: batches of RL rollout rows and the size of each scenario.

A row has ``input_ids`` int64 [L], ``attention_mask`` bool [L], ``old_logprobs`` float32 [L],
per-token ``versions`` int32 [L] (-1 on the first quarter, the prompt; the policy version that
generated each other token: tqstream derives each row's version bounds from them, as it does for
a rollout's) and a float32 scalar ``rewards``: 17 bytes per token plus 4 per row. Ragged fields
are what a rollout has: a list of one tensor per row; every system is handed them so and does its
own conversion inside the timed round.
A trajectory of the producers scenario is what one rollout worker emits: ``input_ids`` int64,
``logprobs`` float32 and per-token ``versions`` int32 (-1 on the prompt), all ragged, and a
float32 ``rewards``: 16 bytes per token plus 4.
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
    "PRODUCERS",
    "SCENARIOS",
    "SWEEP_BATCHES",
    "SWEEP_LENGTH",
    "TRAJECTORY_FIELDS",
    "Batch",
    "Concurrency",
    "Producers",
    "Scenario",
    "Trajectories",
    "make_batch",
    "flat",
    "make_trajectories",
    "make_trajectory",
    "quick",
    "row_ids",
]

FIELDS = ("input_ids", "attention_mask", "old_logprobs", "versions", "rewards")
TRAJECTORY_FIELDS = ("input_ids", "logprobs", "versions", "rewards")


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


@dataclasses.dataclass(frozen=True)
class Producers:
    """``producers`` processes each put ``rows / producers`` rows, ``group`` rows per put (one
    trajectory, or one group of a prompt's samples), ``in_flight`` puts at a time (1: one after
    the other; more: that many asyncio tasks, as an agent-loop worker hands over the rollouts it
    runs at once, each putting its next trajectory as soon as its last put returned or, with
    ``rate`` (rows/s offered by all producers together), each trajectory put when it ends, at the
    times of a Poisson process of that rate, ``in_flight`` puts at most at once: below the
    system's limit, put latency is the put's own, not the queue of a saturated loop), while one
    consumer reads ``batch`` rows at a time and acks them. Trajectory lengths are uniform in
    ``[min_length, max_length]``, the first ``prompt`` tokens of each carry version -1.
    ``warmup_rows`` go through once, untimed, before the measured rounds (connections, worker
    pools and caches warm up; data checked). With ``generate`` (seconds), each of the
    ``in_flight`` rollouts of a producer "generates" for a random 0..``generate`` seconds (an
    ``asyncio.sleep``, seeded per producer), then builds its trajectory — when it ends, not
    beforehand — and puts it, then starts the next one: an agent-loop worker's rollouts, ending
    at random times."""

    group: int = 1
    producers: int = 8
    rows: int = 4096
    batch: int = 256
    min_length: int = 768
    max_length: int = 1280
    prompt: int = 256
    rounds: int = 1
    warmup_rows: int = 256
    in_flight: int = 1
    rate: float = 0.0
    generate: float = 0.0

    def __post_init__(self) -> None:
        # every producer puts the same number of whole puts; the consumer reads whole batches
        for total in (self.rows, self.warmup_rows):
            if total % (self.producers * self.group) or total % self.batch:
                raise ValueError(
                    f"{total} rows must split into {self.producers} producers x puts of "
                    f"{self.group} rows and into batches of {self.batch}"
                )

    def puts(self, rows: int) -> int:
        """Puts per producer for ``rows`` rows in all."""
        return rows // (self.producers * self.group)

    @property
    def case(self) -> str:
        what = "1 trajectory" if self.group == 1 else f"1 group of {self.group}"
        flight = f", {self.in_flight} puts in flight each" if self.in_flight > 1 else ""
        if self.rate:
            flight = f", {self.in_flight} rollouts each, offered {self.rate:,.0f} rows/s"
        if self.generate:
            flight = (
                f", {self.in_flight} rollouts each ending after 0-{self.generate * 1e3:g} ms, "
                f"built then"
            )
        return (
            f"{self.producers} producers x {what} per put{flight}, L {self.min_length}-"
            f"{self.max_length}, batches of {self.batch}, {self.rows} rows"
        )

    def sized(self) -> Producers:
        if not quick():
            return self
        return dataclasses.replace(
            self,
            producers=2,
            rows=16 * self.group * max(1, self.rows // 4096),  # twice for the 8,192-row variants
            batch=4 * self.group,
            min_length=48,
            max_length=80,
            prompt=16,
            warmup_rows=4 * self.group,
        )


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
PRODUCERS = {
    # one trajectory per put is the slow case for every system: half the rows keep the full run
    # within ~2 minutes on 2 cores (TransferQueue moves ~170 of them a second there)
    "trajectory": Producers(group=1, rows=2048),
    "group": Producers(group=8, rows=4096),
    # an agent-loop worker: 32 rollouts at once per process, each handed over when it ends
    "agent": Producers(group=1, rows=4096, in_flight=32),
    # the same workers, their rollouts ending at random times (Poisson) at 40x the rows/s that
    # TransferQueue reaches with one trajectory per put on 2 cores (~100): whether a system keeps
    # up with that rate when puts do not arrive together, and its put latency there
    "agent-paced": Producers(group=1, rows=4096, in_flight=32, rate=4000.0),
    # an agent loop as users run it: each rollout generates for a random 0-2 ms, builds its
    # trajectory when it ends and puts it; beside it the same exchange of prebuilt trajectories
    # put back to back (what "agent" does): their ratio is what ending at random times and building
    # each trajectory then cost (TQSTREAM_BENCH_AGENT_PREBUILT=1: the end times alone)
    "agent-loop": Producers(group=1, rows=8192, in_flight=32, generate=0.002),
    "agent-back-to-back": Producers(group=1, rows=8192, in_flight=32),
}
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
        return flat(self.fields)

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


def flat(fields: Mapping[str, torch.Tensor | list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """:meth:`Batch.flat` of a batch's fields: what a store of raw buffers does with a rollout's
    lists (timed, in the systems that need it)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in fields.items():
        if isinstance(value, list):
            out[name] = torch.cat(value)
            lengths = torch.tensor([0] + [len(t) for t in value], dtype=torch.int64)
            out[f"{name}.offsets"] = lengths.cumsum(0)
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
        "versions": torch.randint(0, 4, (total,), generator=gen, dtype=torch.int32),
    }
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
    at = torch.arange(total) - torch.repeat_interleave(starts, torch.tensor(lengths))
    prompt = torch.repeat_interleave(torch.tensor(lengths) // 4, torch.tensor(lengths))
    flat["versions"][at < prompt] = -1  # each row's first quarter: its prompt
    fields: dict[str, torch.Tensor | list[torch.Tensor]] = {
        name: [r.clone() for r in torch.split(t, lengths)] if ragged else t.view(rows, length)
        for name, t in flat.items()
    }
    fields["rewards"] = torch.arange(first_id, first_id + rows, dtype=torch.float32)
    return Batch(rows, length, ragged, fields)


def row_ids(data: Mapping[str, torch.Tensor]) -> list[int]:
    """The row ids carried by ``rewards``."""
    return [int(x) for x in data["rewards"].tolist()]


@dataclasses.dataclass
class Trajectories:
    """One put of the producers scenario: ``len(rewards)`` trajectories."""

    ragged: dict[str, list[torch.Tensor]]
    """``input_ids``, ``logprobs``, ``versions``: one 1-D tensor per trajectory."""
    rewards: torch.Tensor
    """float32 [k]: the row ids."""

    def fields(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """The dict of lists of tensors a producer starts each put from."""
        return {**self.ragged, "rewards": self.rewards}


def make_trajectory(config: Producers, index: int, *, first_id: int, seed: int) -> Trajectories:
    """Put ``index`` of a producer (``config.group`` trajectories, row ids ``first_id + index *
    group, ...`` in ``rewards``; see :func:`make_batch`), from a generator of its own: the same
    arguments give the same tensors, in whatever order a producer's rollouts build them, so the
    consumer's process can rebuild what a producer process put and compare."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 63))
    lengths = torch.randint(
        config.min_length, config.max_length + 1, (config.group,), generator=gen
    ).tolist()
    ids, logprobs, versions = [], [], []
    for n in lengths:
        ids.append(torch.randint(0, 32000, (n,), generator=gen, dtype=torch.int64))
        logprobs.append(-torch.rand(n, generator=gen))
        version = torch.zeros(n, dtype=torch.int32)
        version[: min(config.prompt, n)] = -1
        versions.append(version)
    start = first_id + index * config.group
    rewards = torch.arange(start, start + config.group, dtype=torch.float32)
    ragged = {"input_ids": ids, "logprobs": logprobs, "versions": versions}
    return Trajectories(ragged, rewards)


def make_trajectories(
    config: Producers, puts: int, *, first_id: int, seed: int
) -> list[Trajectories]:
    """A producer's ``puts`` puts, built beforehand (:func:`make_trajectory` of each)."""
    return [make_trajectory(config, p, first_id=first_id, seed=seed) for p in range(puts)]
