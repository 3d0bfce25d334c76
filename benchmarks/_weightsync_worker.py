"""The receiving rank of the weight-sync benchmark (rank 1 of 2), run as its own process:

    python -m benchmarks._weightsync_worker PORT MODE NBYTES ROUNDS

MODE ``tqstream``: ROUNDS receives through ``WeightReceiver``; ``hub``: ROUNDS announced syncs of a
``WeightHub`` member; ``raw``: ROUNDS plain broadcasts of one NBYTES uint8 tensor on the same
backend (the limit). Prints ``done`` at the end.
"""

from __future__ import annotations

import sys

import torch

from tqstream.reference.weightsync import (
    TorchCollective,
    WeightReceiver,
    WeightSubscription,
    member_receiver,
)


def main() -> None:
    port, mode, nbytes, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    if mode == "hub":
        sub = WeightSubscription("127.0.0.1", port, timeout=600.0)
        member = member_receiver("127.0.0.1", port, sub.member, timeout=600.0)
        for _ in range(rounds):
            sub.next()
            member.receive()
        print("done", flush=True)
        return
    group = TorchCollective(1, 2, port=port, timeout=600.0)
    if mode == "tqstream":
        receiver = WeightReceiver(group)
        for _ in range(rounds):
            receiver.receive()
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        for _ in range(rounds):
            group.broadcast(buffer)
    print("done", flush=True)


if __name__ == "__main__":
    main()
