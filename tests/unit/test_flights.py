"""The group-commit gate of coalesced puts (``coalesce.Flights``): a put waits only while its
key has ``limit`` puts in flight, wakes when one ends, and nothing is left behind."""

from __future__ import annotations

import asyncio

import pytest

from tqstream.client.coalesce import Flights


def test_a_put_goes_at_once_below_the_limit_and_waits_at_it() -> None:
    async def go() -> list[str]:
        flights, order = Flights(), []
        await asyncio.wait_for(flights.below("k", 1), 1)  # nothing in flight: no wait
        ended = asyncio.Event()

        async def flight(name: str) -> None:
            with flights.flying("k"):
                order.append(f"{name} sent")
                await ended.wait()
            order.append(f"{name} ended")

        first = asyncio.create_task(flight("a"))
        await asyncio.sleep(0)
        await asyncio.wait_for(flights.below("k", 2), 1)  # one of two: no wait
        await asyncio.wait_for(flights.below("other", 1), 1)  # another key: no wait
        waiting = asyncio.create_task(flights.below("k", 1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        ended.set()
        await asyncio.wait_for(waiting, 1)
        order.append("next sent")
        await first
        assert not flights._count and not flights._ended  # nothing kept for idle keys
        return order

    assert asyncio.run(go()) == ["a sent", "a ended", "next sent"]


def test_a_failed_flight_wakes_the_waiting_put_too() -> None:
    async def go() -> None:
        flights = Flights()

        async def failing() -> None:
            with flights.flying("k"):
                await asyncio.sleep(0.01)
                raise RuntimeError("refused")

        task = asyncio.create_task(failing())
        await asyncio.sleep(0)
        await asyncio.wait_for(flights.below("k", 1), 1)
        with pytest.raises(RuntimeError):
            await task
        assert not flights._count

    asyncio.run(go())


def test_a_cancelled_waiter_leaves_the_next_one_working() -> None:
    async def go() -> None:
        flights = Flights()
        ended = asyncio.Event()

        async def flight() -> None:
            with flights.flying("k"):
                await ended.wait()

        task = asyncio.create_task(flight())
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(flights.below("k", 1))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        after = asyncio.create_task(flights.below("k", 1))
        await asyncio.sleep(0.01)
        assert not after.done()
        ended.set()
        await asyncio.wait_for(after, 1)
        await task

    asyncio.run(go())
