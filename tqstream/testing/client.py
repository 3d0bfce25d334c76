"""A producer or a consumer run on one host of a rig (:mod:`tqstream.testing.rig`); prints one
JSON line with what it did. Producers put rows ``{"id": int64, "x": float32 [WIDTH]}`` (``x`` all
equal to ``id``), the consumer (task ``t``) checks every row it reads and lists the ids.

    python -m tqstream.testing.client produce ADDRESS KEYS PARTITION FIRST COUNT PER_PUT WIDTH \
        LOCALITY
    python -m tqstream.testing.client consume ADDRESS KEYS PARTITION TOTAL BATCH
"""

from __future__ import annotations

import json
import sys
import time

import torch

import tqstream
from tqstream import ClientConfig


def produce(address: str, keys: str, partition: str, first: int, count: int, per_put: int,
            width: int, locality: str) -> dict[str, object]:  # fmt: skip
    units: list[int] = []
    config = ClientConfig(keys=keys, locality=locality)
    with tqstream.connect(address, config) as client:
        start = time.perf_counter()
        for i in range(first, first + count, per_put):
            n = min(per_put, first + count - i)
            ids = torch.arange(i, i + n, dtype=torch.int64)
            data = {"id": ids, "x": ids.float()[:, None].expand(n, width).contiguous()}
            units += client.put(data, partition).units
        seconds = time.perf_counter() - start
    return {"units": units, "seconds": seconds}


def consume(address: str, keys: str, partition: str, total: int, batch: int) -> dict[str, object]:
    seen: list[int] = []
    with tqstream.connect(address, ClientConfig(keys=keys)) as client:
        start = time.perf_counter()
        while len(seen) < total:
            got = client.get(partition, ["id", "x"], min(batch, total - len(seen)), "t", timeout=60)
            ids, x = got.data["id"], got.data["x"]
            if not torch.equal(x, ids.float()[:, None].expand_as(x)):
                raise AssertionError(f"rows {ids.tolist()} came back with other values")
            seen += ids.tolist()
            got.ack()
        seconds = time.perf_counter() - start
    return {"ids": seen, "seconds": seconds}


if __name__ == "__main__":
    role, address, keys, partition, *rest = sys.argv[1:]
    if role == "produce":
        first, count, per_put, width = map(int, rest[:4])
        out = produce(address, keys, partition, first, count, per_put, width, rest[4])
    else:
        total, batch = map(int, rest)
        out = consume(address, keys, partition, total, batch)
    print(json.dumps(out), flush=True)
