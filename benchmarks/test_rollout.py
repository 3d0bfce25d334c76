"""rollout: what the data plane costs a rollout worker. The reference pipeline's worker loop (the
torch engine over the tiny Qwen2 generating groups of 8 samples of up to ``NEW_TOKENS`` tokens)
runs in a process of its own, alone (``engine-alone``) or putting each group into an embedded
tqstream hosted by the benchmark's process, whose consumer reads whole groups and acks them while
the worker generates (``tqstream-rollout``). The work is the same seeded tokens either way; a
round is one pass over ``GROUPS`` groups, so the time ratio is the throughput cost (target:
≤ 1.05). The cost is per put (``put_ms``, about constant), so its share falls as generations get
longer: the tiny model writes a group of 8 x 32 tokens in ~35 ms on one core, where a real engine
takes seconds. On a 2-core machine the controller, storage unit and consumer share the CPU with
the engine: their CPU is in the figure too.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

from benchmarks._workload import quick

pytest.importorskip("transformers", reason="the rollout benchmark runs the reference engine")

GROUPS = 64  # at 32 tokens; fewer for longer generations (the same tokens in all)
NEW_TOKENS = (32, 128)
SYSTEMS = ("tqstream-rollout", "engine-alone")
FIELDS = ["prompt_ids", "response_ids", "logprobs", "versions", "rewards"]


def _consume(client: Any, stop: threading.Event, seen: list[int]) -> None:
    import tqstream
    from tqstream.adapters.torch import ExperienceDataset, meta_of

    data = ExperienceDataset(client, FIELDS, 4 * 8, partition="rollouts", task="actor",
                             whole_groups=True, ack="manual", timeout=0.2)  # fmt: skip
    while not stop.is_set():
        try:
            for batch in data:
                data.ack(batch)
                seen[0] += len(meta_of(batch).row_ids)
                if stop.is_set():
                    return
        except tqstream.RequestTimeoutError:
            continue


@pytest.mark.parametrize("kind", SYSTEMS)
@pytest.mark.parametrize("new_tokens", NEW_TOKENS[:1] if quick() else NEW_TOKENS)
def test_rollout(benchmark: Any, kind: str, new_tokens: int) -> None:
    import tqstream

    groups = 8 if quick() else GROUPS * 32 // new_tokens
    rounds, warmup = (1, 0) if quick() else (3, 1)
    benchmark.group = "rollout"
    benchmark.extra_info.update(
        system=kind,
        case=f"{groups} groups of 8 x <={new_tokens} tokens, torch engine, tiny Qwen2",
        batch=groups * 8,
        note=(
            "each group put through ExperienceWriter into an embedded tqstream; a consumer reads "
            "whole groups of 4 and acks them meanwhile"
            if kind.startswith("tqstream")
            else "the same generation loop, nothing put"
        ),
    )
    import torch

    torch.set_num_threads(1)
    client = tqstream.init() if kind.startswith("tqstream") else None
    stop, seen = threading.Event(), [0]
    consumer = None
    if client is not None:
        client.create_partition("rollouts", FIELDS, tasks=["actor"])
        consumer = threading.Thread(target=_consume, args=(client, stop, seen), daemon=True)
        consumer.start()
    worker = subprocess.Popen(
        [sys.executable, "-m", "benchmarks._rollout_worker",
         client.address if client is not None else "-", str(groups), str(new_tokens)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert worker.stdin is not None and worker.stdout is not None
    tokens: list[int] = []
    put_s: list[float] = []

    def one_round() -> None:
        worker.stdin.write("go\n")  # type: ignore[union-attr]
        worker.stdin.flush()  # type: ignore[union-attr]
        line = worker.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("done "), line
        tokens.append(int(line.split()[1]))
        put_s.append(float(line.split()[2]))

    try:
        one_round()  # start-up (imports, the model) outside the measure
        benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup, iterations=1)
        assert len(set(tokens)) == 1  # the same work every round
        benchmark.extra_info["tokens"] = tokens[0]
        if benchmark.stats is not None:  # None under --benchmark-disable
            benchmark.extra_info["tokens_per_s"] = tokens[0] / benchmark.stats.stats.median
        benchmark.extra_info["put_ms"] = 1e3 * sorted(put_s)[len(put_s) // 2] / groups
    finally:
        worker.stdin.close()
        worker.wait(60)
        stop.set()
        if consumer is not None:
            consumer.join(10)
        if client is not None:
            client.close()
