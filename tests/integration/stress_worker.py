"""A producer or consumer process of the stress test (run as a script, not collected)."""

from __future__ import annotations

import sys

import torch

import tqstream

TOTAL = 20_000
PRODUCERS = 4
PUT_ROWS = 50
BATCH = 50
FIELDS = ["tokens", "rid", "reward"]


def tokens_of(rid: int) -> torch.Tensor:
    n = rid * 7919 % 97 + 1
    return torch.arange(rid, rid + n, dtype=torch.int32)


def produce(address: str, partition: str, index: int) -> None:
    per = TOTAL // PRODUCERS
    with tqstream.connect(address) as client:
        for start in range(index * per, (index + 1) * per, PUT_ROWS):
            rids = list(range(start, start + PUT_ROWS))
            client.put(
                {
                    "tokens": [tokens_of(r) for r in rids],
                    "rid": torch.tensor(rids, dtype=torch.int64),
                    "reward": torch.tensor(rids, dtype=torch.float64) / 7,
                },
                partition,
                keys=[f"k{r}" for r in rids],
            )


def consume(address: str, partition: str, task: str, out: str) -> None:
    seen: list[int] = []
    with tqstream.connect(address) as client:
        while True:
            try:
                b = client.get(partition, FIELDS, BATCH, task, timeout=1.0)
            except tqstream.RequestTimeoutError:
                if client.stats(partition).partitions[partition].tasks[task].acked >= TOTAL:
                    break
                continue
            for i, rid in enumerate(b.data["rid"].tolist()):
                if not torch.equal(b.data["tokens"][i], tokens_of(rid)):
                    raise AssertionError(f"row {rid}: wrong tokens")
                if b.data["reward"][i].item() != rid / 7:
                    raise AssertionError(f"row {rid}: wrong reward")
                if b.meta.keys[i] != f"k{rid}":
                    raise AssertionError(f"row {rid}: wrong key {b.meta.keys[i]}")
            seen.extend(b.data["rid"].tolist())
            b.ack()
    with open(out, "w") as f:
        f.write("\n".join(map(str, seen)))


if __name__ == "__main__":
    role, address, partition, *rest = sys.argv[1:]
    if role == "produce":
        produce(address, partition, int(rest[0]))
    else:
        consume(address, partition, rest[0], rest[1])
