"""A rollout worker's side of a weight sync, as its own process (see test_weight_sync.py).

    python weight_worker.py PORT RANK WORLD SYNCS [--expect-other] [--idle] [--fresh]
    python weight_worker.py PORT hub - SYNCS [--expect-other] [--after N]

Joins the group, receives SYNCS syncs and checks each against the weights the trainer makes for
that version (the same seeded tensors), printing one JSON line per sync: {"version": v, "ok": bool}
or {"error": class name, "message": ...}. ``--expect-other`` expects a model with one layer of
another shape; ``--idle`` says {"ready": true} once started, joins, says {"joined": true} and then
never receives; ``--fresh`` receives each sync with a new receiver (one that never saw the
metadata). ``hub``: a member of the ``WeightHub`` at PORT (it
registers, says {"member": id}, waits for each announced sync and receives it); ``--after N``:
registers only once N members did; ``--nccl``: receives over NCCL on ``cuda:1``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tqstream.errors import TQStreamError
from tqstream.reference.weightsync import (
    TorchCollective,
    WeightMeta,
    WeightReceiver,
    WeightSubscription,
    member_receiver,
)


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
    other, idle = "--expect-other" in sys.argv, "--idle" in sys.argv
    if sys.argv[2] == "hub":
        hub_member(int(sys.argv[1]), int(sys.argv[4]), other)
        return
    port, rank, world, syncs = (int(a) for a in sys.argv[1:5])
    group = TorchCollective(rank, world, port=port, timeout=20.0)
    if idle:
        print(json.dumps({"ready": True}), flush=True)  # started: it joins at once
        group.join()
        print(json.dumps({"joined": True}), flush=True)
        time.sleep(60)
        return
    receiver = WeightReceiver(group, WeightMeta.of(weights(0, other)))
    for _ in range(syncs):
        if "--fresh" in sys.argv and receiver._meta is not None:
            receiver = WeightReceiver(group, receiver.expected)
        check(receiver, None)


def hub_member(port: int, syncs: int, other: bool) -> None:
    if "--after" in sys.argv:
        sub = None
        while sub is None:
            from tqstream.reference.weightsync.collective import connect_store

            if connect_store("127.0.0.1", port, 20.0).add("tqstream/members", 0) >= int(
                sys.argv[sys.argv.index("--after") + 1]
            ):
                sub = WeightSubscription("127.0.0.1", port, timeout=20.0)
            time.sleep(0.01)
    else:
        sub = WeightSubscription("127.0.0.1", port, timeout=20.0)
    print(json.dumps({"member": sub.member}), flush=True)
    nccl = "--nccl" in sys.argv  # receive on the second GPU
    receiver = member_receiver(
        "127.0.0.1", port, sub.member, timeout=20.0, backend="nccl" if nccl else "gloo",
        device="cuda:1" if nccl else None, expected=WeightMeta.of(weights(0, other)),
    )  # fmt: skip
    for _ in range(syncs):
        check(receiver, sub.next())


def check(receiver: WeightReceiver, announced: int | None) -> None:
    try:
        version, got = receiver.receive()
    except TQStreamError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    got = {k: t.cpu() for k, t in got.items()}
    want = weights(version)
    ok = announced in (None, version) and list(got) == list(want) and all(
        torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.bfloat16 else got[k],
                    want[k].view(torch.uint8) if want[k].dtype == torch.bfloat16 else want[k])
        for k in want
    )  # fmt: skip
    print(json.dumps({"version": version, "ok": ok}), flush=True)


if __name__ == "__main__":
    main()
