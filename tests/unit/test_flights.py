"""The group-commit gate of coalesced puts (``coalesce.Flights``): a put waits only while its
key has ``limit`` puts in flight, wakes when one ends, and nothing is left behind; with a
``fraction``, the first put after a flight ended waits for that flight's callers to put again
when they came back that fast before (and more of them are owed than puts wait)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

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


# --- callers putting again (``fraction`` above 0) -----------------------------------------------
async def _flight(flights: Flights, callers: Sequence[str], seconds: float, key: str = "k") -> None:
    with flights.flying(key, callers):
        await asyncio.sleep(seconds)


def _issue(flights: Flights, callers: Sequence[str], key: str = "k") -> None:
    for caller in callers:
        flights.issued(key, caller)


ABC = ("a", "b", "c")


def test_the_first_put_after_a_flight_waits_for_its_callers_once_they_came_back_fast() -> None:
    """Nothing is waited for until a flight's callers were seen back within its time; then the
    put going first after the next flight waits for them, until the last one has put again —
    not the whole window — and puts of others do not count."""

    async def go() -> None:
        flights = Flights(1.0)
        loop = asyncio.get_running_loop()
        await _flight(flights, ABC, 0.2)
        await asyncio.wait_for(flights.rejoined("k", 1), 0.01)  # nothing learnt yet
        _issue(flights, ABC)  # the three callers, at once: back in time
        await _flight(flights, ABC, 0.2)
        waiting = asyncio.create_task(flights.rejoined("k", 1))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        _issue(flights, ["a", "b", "x", "y", "a"])  # others, and a twice: c still owed
        await asyncio.sleep(0.02)
        assert not waiting.done()
        began = loop.time()
        flights.issued("k", "c")
        await asyncio.wait_for(waiting, 1)
        assert loop.time() - began < 0.05
        await asyncio.wait_for(flights.rejoined("k", 1), 0.01)  # nobody owed now

    asyncio.run(go())


def test_callers_not_back_within_a_flights_time_are_not_waited_for_again() -> None:
    """A put waits at most ``fraction`` of a flight's time; callers who are not all back in it
    (a task per rollout, ended with its put; rollouts longer than a put) turn the waiting off
    until they are seen back in time again."""

    async def go() -> None:
        flights = Flights(0.5)
        loop = asyncio.get_running_loop()
        await _flight(flights, "ab", 0.1)
        _issue(flights, "ab")  # back at once
        await _flight(flights, "ab", 0.1)
        began = loop.time()
        await asyncio.wait_for(flights.rejoined("k", 1), 1)  # nobody back: the window, 50 ms
        assert 0.04 < loop.time() - began < 0.09
        await _flight(flights, "ab", 0.1)
        await asyncio.wait_for(flights.rejoined("k", 1), 0.01)  # off
        await asyncio.sleep(0.06)
        _issue(flights, "ab")  # back, but after the window: still off
        await _flight(flights, "ab", 0.1)
        await asyncio.wait_for(flights.rejoined("k", 1), 0.01)
        _issue(flights, "ab")  # back in time: on again
        await _flight(flights, "ab", 0.1)
        waiting = asyncio.create_task(flights.rejoined("k", 1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        _issue(flights, "ab")
        await asyncio.wait_for(waiting, 0.01)

    asyncio.run(go())


def test_no_wait_when_more_wait_than_are_owed_nor_for_a_lone_caller() -> None:
    async def go() -> None:
        flights = Flights(1.0)
        await _flight(flights, "abcd", 0.05)
        _issue(flights, "abcd")
        await _flight(flights, "abcd", 0.05)
        await asyncio.wait_for(flights.rejoined("k", 5), 0.01)  # 4 owed, 5 waiting
        _issue(flights, "abcd")
        await _flight(flights, "a", 0.05)
        flights.issued("k", "a")  # a caller putting in a loop: its own next put, about to go
        await asyncio.wait_for(flights.rejoined("k", 1), 0.01)

    asyncio.run(go())


def test_a_cancelled_wait_for_callers_leaves_the_next_one_working() -> None:
    async def go() -> None:
        flights = Flights(1.0)
        await _flight(flights, "ab", 0.2)
        _issue(flights, "ab")
        await _flight(flights, "ab", 0.2)
        cancelled = asyncio.create_task(flights.rejoined("k", 1))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        after = asyncio.create_task(flights.rejoined("k", 1))
        await asyncio.sleep(0.01)
        assert not after.done()
        _issue(flights, "ab")
        await asyncio.wait_for(after, 0.01)

    asyncio.run(go())


def test_nothing_waits_without_a_fraction_and_idle_keys_are_let_go() -> None:
    async def go() -> None:
        off = Flights()
        await _flight(off, "abcd", 0.01)
        off.issued("k", "a")
        await asyncio.wait_for(off.rejoined("k", 1), 0.01)
        assert not off._rejoin

        flights = Flights(1.0)
        for i in range(200):  # one put to each of many partitions, its caller never back
            await _flight(flights, [f"c{i}"], 0.001, key=f"p{i}")
        assert len(flights._rejoin) <= 40, len(flights._rejoin)

    asyncio.run(go())
