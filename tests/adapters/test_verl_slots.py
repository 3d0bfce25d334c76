"""``ReplayBufferSlots``: the fully-async TransferQueue recipe's slot calls, as verl makes them.

The recipe's ``ReplayBuffer`` (verl PR #6628, not in the verl 0.9.1 wheel) is a Ray actor with
``async def acquire_slot(self, timeout: float | None = None, uid: str = "") -> bool``,
``async def release_slot(self) -> None`` and ``async def reset_staleness(self) -> dict``; when a
verl that ships it is installed, the signatures are compared with the real class instead.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import pickle
import time

import pytest

pytest.importorskip("verl")

import tqstream
from tqstream.adapters.verl import ReplayBufferSlots

PR_SIGNATURES = {
    "acquire_slot": "(self, timeout: float | None = None, uid: str = '') -> bool",
    "release_slot": "(self) -> None",
    "reset_staleness": "(self) -> dict",
}


def _verl_replay_buffer() -> type | None:
    name = "verl.experimental.fully_async_policy.replay_buffer"
    if importlib.util.find_spec(name) is None:
        return None
    actor = importlib.import_module(name).ReplayBuffer
    return actor.__ray_metadata__.modified_class  # the class under @ray.remote


def test_verls_exact_signatures() -> None:
    real = _verl_replay_buffer()
    for name, expected in PR_SIGNATURES.items():
        ours = getattr(ReplayBufferSlots, name)
        assert inspect.iscoroutinefunction(ours), name
        if real is not None:
            theirs = inspect.signature(getattr(real, name))
            assert [(p.name, p.default) for p in inspect.signature(ours).parameters.values()] == [
                (p.name, p.default) for p in theirs.parameters.values()
            ], name
        else:
            assert str(inspect.signature(ours, eval_str=True)) == expected, name
        assert callable(getattr(ReplayBufferSlots, f"{name}_sync"))


def test_layer_one_bounds_samples_in_flight(client: tqstream.Client, partition: str) -> None:
    async def main() -> None:
        slots = ReplayBufferSlots(
            client, max_version_slots=100, max_pending_slots=2, name=partition
        )
        assert await slots.acquire_slot(uid="s0") and await slots.acquire_slot(uid="s1")
        start = time.monotonic()
        assert await slots.acquire_slot(timeout=0.2) is False  # full: verl returns False
        assert time.monotonic() - start >= 0.15
        waiter = asyncio.create_task(slots.acquire_slot())  # waits as long as it takes
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await slots.release_slot()  # no id: the recipe's call, unchanged
        assert await asyncio.wait_for(waiter, 10) is True
        stats = await slots.get_statistics()
        assert (stats["pending_slots"], stats["available_physical_slots"]) == (2, 0)
        assert (stats["version_slots"], stats["held_slots"]) == (3, 2)

    asyncio.run(main())


def test_layer_two_waits_for_reset_staleness_from_the_trainer(
    client: tqstream.Client, partition: str
) -> None:
    """The rollouter and the trainer each build one on the same name: the trainer's
    ``reset_staleness()`` after a weight sync lets the rollouter's waiting ``acquire_slot`` go."""

    async def main() -> None:
        rollouter = ReplayBufferSlots(client, max_version_slots=2, name=partition)
        trainer = ReplayBufferSlots(client, max_version_slots=2, name=partition)
        for _ in range(2):
            assert await rollouter.acquire_slot()
            await rollouter.release_slot()  # written: in flight again 0, window still counts it
        waiter = asyncio.create_task(rollouter.acquire_slot(timeout=30))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        timing = await trainer.reset_staleness()
        assert await asyncio.wait_for(waiter, 10) is True
        assert timing["fully_async/rollouter/version_time"] > 0
        assert timing["tqstream/slots/resets"] == 1.0
        stats = await trainer.get_statistics()
        assert stats["version_slots"] == 1 and stats["max_version_slots"] == 2

    asyncio.run(main())


def test_sync_twins(client: tqstream.Client, partition: str) -> None:
    slots = ReplayBufferSlots(client, 1, 1, name=partition)
    assert slots.acquire_slot_sync(timeout=0) is True
    assert slots.acquire_slot_sync(timeout=0.1) is False
    slots.release_slot_sync()
    assert slots.acquire_slot_sync(timeout=0.1) is False  # layer 2: one per version
    assert isinstance(slots.reset_staleness_sync(), dict)
    assert slots.acquire_slot_sync(timeout=0) is True
    assert slots.get_statistics_sync()["held_slots"] == 1


def test_a_release_without_a_held_slot_is_refused(client: tqstream.Client, partition: str) -> None:
    slots = ReplayBufferSlots(client, max_version_slots=4, name=partition)
    assert slots.acquire_slot_sync()
    slots.release_slot_sync()
    with pytest.raises(tqstream.AdmissionError, match=r"this object holds no slot"):
        slots.release_slot_sync()
    with pytest.raises(tqstream.AdmissionError, match=r"release each slot once"):
        asyncio.run(slots.release_slot())
    state = client.stats().admissions[partition]
    assert (state["running"], state["accepted"]) == (0, 1)  # counted once


def test_a_configuration_that_would_deadlock_is_refused(
    client: tqstream.Client, partition: str
) -> None:
    with pytest.raises(
        tqstream.AdmissionError, match=r"max_version_slots=2 < consumer_batch_size=4"
    ):
        ReplayBufferSlots(client, max_version_slots=2, consumer_batch_size=4, name=partition)
    assert partition not in client.stats().admissions


def test_pickles_as_its_address(client: tqstream.Client, partition: str) -> None:
    slots = ReplayBufferSlots(client, max_version_slots=3, max_pending_slots=1, name=partition)
    copy = pickle.loads(pickle.dumps(slots))
    try:
        assert copy.acquire_slot_sync(timeout=0)
        assert slots.acquire_slot_sync(timeout=0.1) is False  # one state, at the controller
        copy.release_slot_sync()
        assert slots.acquire_slot_sync(timeout=1)
    finally:
        copy.close()
