"""The receiving rank of the weight-sync benchmark (rank 1 of 2), run as its own process:

    python -m benchmarks._weightsync_worker PORT MODE NBYTES ROUNDS

MODE ``tqstream``: ROUNDS receives through ``WeightReceiver``; ``raw``: ROUNDS plain broadcasts of
one NBYTES uint8 tensor on the same backend (the limit). Prints ``done`` at the end.
"""

from __future__ import annotations

import sys

import torch

from tqstream.reference.weightsync import TorchCollective, WeightReceiver


def main() -> None:
    port, mode, nbytes, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
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
