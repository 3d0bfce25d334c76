"""Races between a clear and puts in flight to a re-created partition of the same name."""

from __future__ import annotations

import contextlib
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


def test_stale_evictions_return_budget_so_the_trainer_is_not_starved() -> None:
    """Capacity admission with max_staleness=0: a partial rollout that straddles a weight update
    is evicted by the window; without giving its budget back, no producer could ever fill the
    trainer's next batch (a deadlock)."""
    with tqstream.init() as client:
        adm = client.admission(
            "capacity", name="r", max_concurrent=4, max_staleness=0, consumer_batch_size=2
        )
        client.create_partition("train", ["tok"], admission="r")

        def put(version: int, versions: list[list[int]], group: str) -> None:
            slots = adm.acquire(2, version=version, timeout=5)
            data = {"tok": [torch.arange(2)] * 2, "versions": [torch.tensor(v) for v in versions]}
            client.put(data, "train", groups=[group] * 2, version=version)
            adm.release(slots, "accepted")

        def get(version: int, timeout: float) -> tqstream.Batch:
            return client.get(
                "train", "tok", 2, "actor", whole_groups=True, timeout=timeout,
                current_version=version, max_staleness=0, on_stale="drop",
            )  # fmt: skip

        put(0, [[0, 0], [0, 0]], "a")
        get(0, 5).ack()
        adm.on_version(1)
        put(1, [[0, 1], [1, 1]], "b")  # head version 0: stale at version 1
        with contextlib.suppress(tqstream.RequestTimeoutError):
            get(1, 0.3)  # evicts group b as stale
        assert client.stats("train").partitions["train"].stale_dropped == 2
        assert adm.state()["dropped"] == 2
        put(1, [[1, 1], [1, 1]], "c")  # would block forever without the budget back
        assert get(1, 5).meta.version_start == [1, 1]
