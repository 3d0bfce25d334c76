"""Races between a clear and puts in flight to a re-created partition of the same name."""

from __future__ import annotations

import threading
import time

import torch

import tqstream


def test_put_waiting_for_room_survives_clear_partition() -> None:
    """The waiting put is planned for the re-created partition the moment the clear frees its
    bytes, and can reach the unit before the drop order: it must neither collide with the old
    rows nor lose its bytes to the drop."""
    for _ in range(5):  # the race goes either way; both orders must be right
        with tqstream.init(storage_max_bytes=4096) as client:
            client.put({"x": torch.zeros(4, 256)}, "q")  # 4096 bytes: the unit is full
            done: list[object] = []

            def put_when_room(c: tqstream.Client = client, out: list[object] = done) -> None:
                out.append(c.put({"x": torch.ones(1, 256)}, "q", timeout=20))

            waiter = threading.Thread(target=put_when_room)
            waiter.start()
            time.sleep(0.2)
            client.clear_partition("q")
            waiter.join(20)
            assert done, "the waiting put did not complete"
            got = client.get("q", "x", 1, "t", timeout=5)
            assert torch.equal(got.data["x"], torch.ones(1, 256))
            assert client.stats().storage_bytes == 1024
