"""Rollout producers -> a PyTorch DataLoader with workers, through tqstream's torch adapter.

Two producer processes put one trajectory per call (ragged token ids, per-token versions, a
reward); the trainer reads batches of 16 with two DataLoader workers through a staleness window,
acks each batch after its step, and stops once the producers closed the partition and every row
was trained. Runs on the embedded default, on CPU, in seconds: python examples/torch_dataloader.py
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

import tqstream
from tqstream import StalenessPolicy
from tqstream.adapters.torch import ExperienceDataset, ExperienceWriter

PRODUCERS, PER_PRODUCER, BATCH = 2, 64, 16


def produce(address: str, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    with ExperienceWriter(address, partition="train") as writer:  # closes it for this producer
        for i in range(PER_PRODUCER):
            version = i // 32  # the policy version that generated this trajectory
            prompt, response = 8, int(torch.randint(4, 32, (1,), generator=gen))
            versions = torch.cat([torch.full((prompt,), -1), torch.full((response,), version)])
            writer.put_experience(
                {
                    "input_ids": [torch.randint(0, 1000, (prompt + response,), generator=gen)],
                    "versions": [versions],
                    "rewards": [float(torch.rand((), generator=gen))],
                },
                current_version=version,
                group=f"p{rank}-{i}",
            )


def main() -> None:
    client = tqstream.init()
    client.create_partition("train", ["input_ids", "rewards"], producers=PRODUCERS)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=produce, args=(client.address, r)) for r in range(PRODUCERS)]
    for p in procs:
        p.start()
    ds = ExperienceDataset(
        client.address, ["input_ids", "rewards"], BATCH, partition="train",
        staleness=StalenessPolicy(max_staleness=1), version_fn=lambda: 1,
        ack="manual", finite=True, padded=True,
    )  # fmt: skip
    start, rows, steps = time.perf_counter(), 0, 0
    for batch in ds.loader(num_workers=2):
        loss = (batch["input_ids"].float().mean() * batch["rewards"].mean()).item()  # a "step"
        ds.ack(batch)  # after the step: a crash before this line loses nothing
        rows, steps = rows + len(batch), steps + 1
        print(f"step {steps:2d}: {len(batch):2d} rows, padded to {batch['input_ids'].shape[1]:2d} "
              f"tokens, loss {loss:8.2f}")  # fmt: skip
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    print(f"trained {rows} of {PRODUCERS * PER_PRODUCER} rows in {steps} steps, {elapsed:.2f} s")
    print(client.stats("train"))
    client.close()


if __name__ == "__main__":
    main()
