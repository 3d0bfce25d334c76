"""weightsync: the trainer's weights to one rollout worker over gloo (two processes), tqstream's
``WeightSender``/``WeightReceiver`` (tensors of 1 MiB or more sent from their own memory, smaller
ones packed into 64 MiB buckets; metadata once) against one raw
``torch.distributed`` broadcast of the same bytes on the same backend — the limit of that transport.

The weights are a synthetic state dict of float32/bfloat16 matrices the size of a transformer's
layers (``SIZES``). A round is one sync, from the sender's call to its return (a broadcast returns
on the root once the receiver has the data). The receiver is a process of its own, started per
case.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from benchmarks._workload import quick
from tqstream.reference.weightsync import TorchCollective, WeightHub, WeightMeta, WeightSender

MiB = 1 << 20
SIZES = (64, 256, 1024)  # MiB of weights
SYSTEMS = ("tqstream-weightsync", "tqstream-weighthub", "torch-broadcast")


def state_dict(mib: int) -> dict[str, torch.Tensor]:
    """Layers of 4 MiB (1024 x 1024 float32) and 2 MiB (bfloat16) matrices, ``mib`` in all."""
    out, left, i = {}, mib * MiB, 0
    while left > 0:
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        rows = max(1, min(1024, left // (1024 * dtype.itemsize)))
        out[f"layers.{i}.weight"] = torch.randn(rows, 1024).to(dtype)
        left -= rows * 1024 * dtype.itemsize
        i += 1
    return out


@pytest.mark.parametrize("kind", SYSTEMS)
@pytest.mark.parametrize("mib", SIZES[:1] if quick() else SIZES)
def test_weightsync(benchmark: Any, kind: str, mib: int) -> None:
    weights = state_dict(mib)
    nbytes = WeightMeta.of(weights).total
    rounds, warmup = (1, 0) if quick() else ((3, 1) if mib >= 1024 else (5, 1))
    benchmark.group = "weightsync"
    benchmark.extra_info.update(
        system=kind,
        case=f"{mib} MiB of weights, gloo, 2 processes",
        bytes=nbytes,
        batch=mib,
        note={
            "tqstream-weightsync": "WeightSender.send -> WeightReceiver.receive (control record "
            "and range table, metadata header once; tensors of 1 MiB or more sent as they are, "
            "smaller ones packed)",
            "tqstream-weighthub": "WeightHub.send -> one member (WeightSubscription.next, then "
            "its receiver): the announcement through the rendezvous store, then the same stream",
            "torch-broadcast": "one ProcessGroupGloo broadcast of the same bytes as one uint8 "
            "tensor",
        }[kind],
    )
    mode = {"tqstream-weightsync": "tqstream", "tqstream-weighthub": "hub"}.get(kind, "raw")
    hub = WeightHub(timeout=600.0, bucket_bytes=64 * MiB) if mode == "hub" else None
    group = TorchCollective(0, 2, timeout=600.0) if hub is None else None
    port = hub.port if hub is not None else group.port  # type: ignore[union-attr]
    worker = subprocess.Popen(
        [sys.executable, "-m", "benchmarks._weightsync_worker", str(port), mode,
         str(nbytes), str(rounds + warmup)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        version = iter(range(1, 1 << 30))
        if hub is not None:
            hub.wait_members(1)
            benchmark.pedantic(lambda: hub.send(weights, next(version)), rounds=rounds,
                               warmup_rounds=warmup, iterations=1)  # fmt: skip
        elif mode == "tqstream":
            assert group is not None
            sender = WeightSender(group, bucket_bytes=64 * MiB)
            benchmark.pedantic(lambda: sender.send(weights, next(version)), rounds=rounds,
                               warmup_rounds=warmup, iterations=1)  # fmt: skip
        else:
            assert group is not None
            flat = torch.empty(nbytes, dtype=torch.uint8)
            benchmark.pedantic(group.broadcast, args=(flat,), rounds=rounds,
                               warmup_rounds=warmup, iterations=1)  # fmt: skip
        out, _ = worker.communicate(timeout=600)
        assert worker.returncode == 0 and out.strip() == "done"
    finally:
        if hub is not None:
            hub.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
