"""A rollout worker's side of a weight sync, as its own process (see test_weight_sync.py).

    python weight_worker.py PORT RANK WORLD SYNCS [--expect-other] [--idle] [--fresh]

Joins the group, receives SYNCS syncs and checks each against the weights the trainer makes for
that version (the same seeded tensors), printing one JSON line per sync: {"version": v, "ok": bool}
or {"error": class name, "message": ...}. ``--expect-other`` expects a model with one layer of
another shape; ``--idle`` joins and then never receives; ``--fresh`` receives each sync with a new
receiver (one that never saw the metadata).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tqstream.errors import TQStreamError
from tqstream.reference.weightsync import TorchCollective, WeightMeta, WeightReceiver


def weights(version: int, other: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + version)
    out = {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layers.0.mlp.weight": torch.randn(48, 32, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.bias": torch.randn(48 if not other else 47, generator=gen),
        "lm_head.weight": torch.randn(64, 32, generator=gen),
        "step": torch.tensor([version], dtype=torch.int64),
    }
    return out


def main() -> None:
    port, rank, world, syncs = (int(a) for a in sys.argv[1:5])
    other, idle = "--expect-other" in sys.argv, "--idle" in sys.argv
    group = TorchCollective(rank, world, port=port, timeout=20.0)
    if idle:
        group.join()
        print(json.dumps({"joined": True}), flush=True)
        time.sleep(60)
        return
    receiver = WeightReceiver(group, WeightMeta.of(weights(0, other)))
    for _ in range(syncs):
        if "--fresh" in sys.argv and receiver._meta is not None:
            receiver = WeightReceiver(group, receiver.expected)
        try:
            version, got = receiver.receive()
        except TQStreamError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
            continue
        want = weights(version)
        ok = list(got) == list(want) and all(
            torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.bfloat16 else got[k],
                        want[k].view(torch.uint8) if want[k].dtype == torch.bfloat16 else want[k])
            for k in want
        )  # fmt: skip
        print(json.dumps({"version": version, "ok": ok}), flush=True)


if __name__ == "__main__":
    main()
