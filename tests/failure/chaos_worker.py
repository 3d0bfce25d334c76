"""A client process of the controller-chaos test: a producer with rollouts in flight, or a
consumer of one task. It runs until the file ``STOP`` exists, then prints one JSON line: the row
ids it put (each put that returned) or read (each batch whose ack returned), and the errors it met.

    python chaos_worker.py ADDRESS produce ID STOP
    python chaos_worker.py ADDRESS consume TASK STOP
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys

import torch

import tqstream

CONFIG = tqstream.ClientConfig(connect_timeout=5.0, reconnect_timeout=60.0)
IN_FLIGHT = 8


async def produce(address: str, ident: int, stop: str) -> dict[str, object]:
    client = tqstream.connect(address, CONFIG)
    put: list[int] = []
    errors: list[str] = []
    seq = 0

    async def rollout() -> None:
        nonlocal seq
        while not os.path.exists(stop) and not errors:
            await asyncio.sleep(random.uniform(0.0, 0.02))  # "generating"
            seq += 1
            row = ident * 10_000_000 + seq
            tokens = random.randint(4, 64)
            data = {
                "id": torch.tensor([row], dtype=torch.int64),
                "tokens": [torch.full((tokens,), row % 1000, dtype=torch.int32)],
            }
            try:
                await client.async_put(data, "p", timeout=120)
            except tqstream.TQStreamError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            put.append(row)

    await asyncio.gather(*(rollout() for _ in range(IN_FLIGHT)))
    client.close()
    return {"put": put, "errors": errors}


async def consume(address: str, task: str, stop: str) -> dict[str, object]:
    client = tqstream.connect(address, CONFIG)
    read: list[int] = []
    errors: list[str] = []
    while not errors:
        try:
            batch = await client.async_get("p", ["id", "tokens"], 16, task, timeout=1.0)
        except (tqstream.RequestTimeoutError, tqstream.ControllerUnavailableError):
            # nothing to read, or the controller is away (a lease it granted meanwhile comes
            # back at lease_timeout): try again
            if os.path.exists(stop):
                break
            continue
        except tqstream.TQStreamError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            break
        ids = batch.columns["id"].values.view(-1).tolist()
        tokens = batch.columns["tokens"]
        assert tokens.offsets is not None
        firsts = tokens.values[tokens.offsets[:-1]].tolist()
        if any(t != i % 1000 for t, i in zip(firsts, ids, strict=True)):
            errors.append(f"rows {ids} hold another row's tokens")
        try:
            await batch.async_ack()
        except tqstream.TQStreamError as exc:
            errors.append(f"ack: {type(exc).__name__}: {exc}")
            break
        read.extend(ids)
    client.close()
    return {"read": read, "errors": errors}


def main() -> None:
    address, mode, who, stop = sys.argv[1:5]
    print("READY", flush=True)
    if mode == "produce":
        out = asyncio.run(produce(address, int(who), stop))
    else:
        out = asyncio.run(consume(address, who, stop))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
