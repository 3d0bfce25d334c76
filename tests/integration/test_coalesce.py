"""Coalesced puts: concurrent puts of one client go as one message and one commit, each caller
getting its own rows, and a refusal fails only the put it is about — on both deployments."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tqstream
from tqstream.client.core import ClientCore
from tqstream.config import ClientConfig
from tqstream.errors import ConfigError, DuplicateKeyError, GroupError, SchemaError


class Held:
    """One-exchange puts, held before they are sent until ``released`` is set; ``sends`` counts
    them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sends: list[int] = []
        self.released = threading.Event()  # the client's loop may be another thread's
        send = ClientCore._put_direct

        async def held(core: ClientCore, req: Any, *args: Any) -> Any:
            self.sends.append(req.n_rows)
            while not self.released.is_set():
                await asyncio.sleep(0.001)
            return await send(core, req, *args)

        monkeypatch.setattr(ClientCore, "_put_direct", held)

    async def sent(self, n: int) -> None:
        while len(self.sends) < n:
            await asyncio.sleep(0.001)

    async def in_flight(self, puts: Any) -> list[asyncio.Future[Any]]:
        """Issue ``puts`` (coroutines) one loop turn apart, each in flight before the next."""
        out = []
        for i, put in enumerate(puts):
            out.append(asyncio.ensure_future(put))
            await self.sent(i + 1)
        return out

    @staticmethod
    async def apart(puts: Any) -> list[asyncio.Future[Any]]:
        """Issue ``puts`` in loop turns of their own."""
        out = []
        for put in puts:
            out.append(asyncio.ensure_future(put))
            await asyncio.sleep(0.001)
        return out


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every one-exchange put a client of this process sends."""
    held = Held(monkeypatch)
    held.released.set()  # none held
    return held.sends


@pytest.fixture
def windowed(deployment: tuple[str, str]) -> Iterator[tqstream.Client]:
    # a wide window: the puts of these tests must meet even on a loaded machine
    c = tqstream.connect(deployment[1], ClientConfig(coalesce_window=0.25))
    yield c
    c.close()


def trajectory(i: int) -> dict[str, Any]:
    return {"tokens": [torch.arange(i % 7 + 1)], "reward": torch.tensor([float(i)])}


async def put_all(client: tqstream.Client, partition: str, n: int, **kw: Any) -> list[Any]:
    return await asyncio.gather(
        *(client.async_put(trajectory(i), partition, version=i % 3, **kw) for i in range(n))
    )


def test_concurrent_puts_go_as_one_and_each_caller_gets_its_own_rows(
    client: tqstream.Client, partition: str, sends: list[int]
) -> None:
    metas = asyncio.run(put_all(client, partition, 32, tags=None))
    assert sends == [32]  # one message, one commit
    assert [len(m) for m in metas] == [1] * 32
    assert len({m.row_ids[0] for m in metas}) == 32
    assert [m.version_start for m in metas] == [[i % 3] for i in range(32)]
    got = client.get(partition, ["tokens", "reward"], 32, "t", timeout=10)
    by_row = dict(zip(got.meta.row_ids, range(32), strict=True))
    for i, m in enumerate(metas):
        row = by_row[m.row_ids[0]]
        assert torch.equal(got.data["tokens"][row], torch.arange(i % 7 + 1))
        assert float(got.data["reward"][row]) == float(i)
        assert got.meta.version_start[row] == i % 3
    client.ack(got.meta)


def test_a_refused_put_fails_only_its_own_caller(
    client: tqstream.Client, partition: str, sends: list[int]
) -> None:
    client.put(trajectory(0), partition, keys=["taken"])
    sends.clear()

    async def go() -> list[Any]:
        return await asyncio.gather(
            *(
                client.async_put(trajectory(i), partition, keys=[k])
                for i, k in enumerate(["a", "taken", "b", "c"])
            ),
            return_exceptions=True,
        )

    a, taken, b, c = asyncio.run(go())
    assert isinstance(taken, DuplicateKeyError)
    assert [m.keys for m in (a, b, c)] == [["a"], ["b"], ["c"]]
    assert sends[0] == 4 and sorted(sends[1:]) == [1, 1, 1, 1]  # refused whole, then one by one
    assert client.stats(partition).partitions[partition].rows == 4  # nothing more, nothing less


def test_puts_that_cannot_travel_together_go_on_their_own(
    client: tqstream.Client, partition: str, sends: list[int]
) -> None:
    async def go() -> list[Any]:
        return await asyncio.gather(
            client.async_put(trajectory(0), partition),
            client.async_put({"other": torch.zeros(1, 2)}, partition),  # other fields
            client.async_put(trajectory(1), partition, groups=["g"]),  # the same group, each
            client.async_put(trajectory(2), partition, groups=["g"]),  # sized by its own put
            client.async_put(trajectory(3), partition, groups=["h"]),
            return_exceptions=True,
        )

    out = asyncio.run(go())
    assert sorted(sends) == [1, 1, 1, 2]  # the first and the "h" one together
    # as one after the other: the first "g" put makes a group of one, the second is refused
    assert sum(isinstance(x, GroupError) for x in out) == 1
    assert not any(isinstance(x, Exception) and not isinstance(x, GroupError) for x in out)


def test_a_window_gathers_puts_issued_apart(
    windowed: tqstream.Client, partition: str, sends: list[int]
) -> None:
    async def go() -> list[Any]:
        async def later(i: int) -> Any:
            await asyncio.sleep(0.002 * i)
            return await windowed.async_put(trajectory(i), partition)

        return await asyncio.gather(*(later(i) for i in range(5)))

    metas = asyncio.run(go())
    assert sends == [5] and [len(m) for m in metas] == [1] * 5


def test_threads_of_the_sync_api_coalesce_safely(
    windowed: tqstream.Client, partition: str, sends: list[int]
) -> None:
    metas: list[Any] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            metas.append(windowed.put(trajectory(i), partition, keys=[f"k{i}"]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(k for m in metas for k in m.keys) == sorted(f"k{i}" for i in range(8))
    assert sum(sends) == 8 and len(sends) < 8


def test_coalescing_off(deployment: tuple[str, str], partition: str, sends: list[int]) -> None:
    with tqstream.connect(deployment[1], ClientConfig(coalesce_window=None)) as c:
        asyncio.run(put_all(c, partition, 4))
    assert sends == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="coalesce_window must be >= 0"):
        ClientConfig(coalesce_window=-1.0)


def test_a_schema_clash_inside_a_merged_put_fails_its_own_caller(
    client: tqstream.Client, partition: str
) -> None:
    client.put({"x": torch.zeros(1, 2)}, partition)

    async def go() -> list[Any]:
        return await asyncio.gather(
            client.async_put({"x": torch.zeros(1, 2)}, partition),
            client.async_put({"x": torch.zeros(1, 3)}, partition),  # stored as [2]
            client.async_put({"x": torch.ones(1, 2)}, partition),
            return_exceptions=True,
        )

    ok1, bad, ok2 = asyncio.run(go())
    assert isinstance(bad, SchemaError) and len(ok1) == len(ok2) == 1
    assert client.stats(partition).partitions[partition].rows == 3


def test_a_put_cancelled_before_it_is_sent_is_not_made(
    windowed: tqstream.Client, partition: str, sends: list[int]
) -> None:
    async def go() -> tuple[Any, ...]:
        first = asyncio.ensure_future(windowed.async_put(trajectory(0), partition, keys=["a"]))
        second = asyncio.ensure_future(windowed.async_put(trajectory(1), partition, keys=["b"]))
        third = asyncio.ensure_future(windowed.async_put(trajectory(2), partition, keys=["c"]))
        await asyncio.sleep(0.01)  # all three wait in the window
        first.cancel()  # the one that would have sent them
        second.cancel()
        return await asyncio.gather(first, second, third, return_exceptions=True)

    first, second, third = asyncio.run(go())
    assert isinstance(first, asyncio.CancelledError) and isinstance(second, asyncio.CancelledError)
    assert third.keys == ["c"] and sends == [1]
    assert windowed.list_keys(partition) == ["c"]


def test_concurrent_acks_and_releases_go_as_one_message_each_answered_alone(
    client: tqstream.Client, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import msgspec

    from tqstream.errors import UnknownLeaseError

    sent: list[int] = []
    send = ClientCore._send_consume

    async def counted(self: ClientCore, items: Any) -> None:
        sent.append(len(items))
        await send(self, items)

    monkeypatch.setattr(ClientCore, "_send_consume", counted)
    client.put({"x": torch.arange(8.0).reshape(8, 1)}, partition)
    batches = [client.get(partition, "x", 2, "t", timeout=10) for _ in range(4)]
    foreign = msgspec.structs.replace(batches[3].meta, task="other")

    async def go() -> list[Any]:
        return await asyncio.gather(
            client.async_ack(batches[0].meta),
            client.async_ack(batches[1].meta),
            client.async_release(batches[2].meta),
            client.async_ack(foreign),  # not this task's lease: fails alone
            return_exceptions=True,
        )

    first, second, released, bad = asyncio.run(go())
    assert sent == [4] and (first, second, released) == (2, 2, 2)
    assert isinstance(bad, UnknownLeaseError)
    t = client.stats(partition).partitions[partition].tasks["t"]
    assert (t.acked, t.leased, t.available) == (4, 2, 2)
    client.ack(batches[3].meta)


def test_puts_that_grow_past_direct_put_bytes_together_are_placed(
    deployment: tuple[str, str], partition: str, sends: list[int]
) -> None:
    config = ClientConfig(direct_put_bytes=1000)
    with tqstream.connect(deployment[1], config) as c:

        async def go() -> list[Any]:
            return await asyncio.gather(
                *(c.async_put({"x": torch.full((1, 100), float(i))}, partition) for i in range(4))
            )

        metas = asyncio.run(go())  # 400 bytes each: one exchange alone, 1,600 together
        assert sends == [] and [len(m) for m in metas] == [1] * 4
        got = c.get(partition, "x", 4, "t", timeout=10)
        values = sorted(float(v) for v in got.data["x"][:, 0])
        assert values == [0.0, 1.0, 2.0, 3.0]


def units(deployment: tuple[str, str]) -> int:
    """Puts of one kind that go at once: one per storage unit (both on this host)."""
    return 1 if deployment[0] == "embedded" else 2


def test_puts_issued_while_one_is_in_flight_go_together_after_it(
    deployment: tuple[str, str], client: tqstream.Client, partition: str, monkeypatch: Any
) -> None:
    held, n = Held(monkeypatch), units(deployment)

    async def go() -> list[Any]:
        first = await held.in_flight(client.async_put(trajectory(i), partition) for i in range(n))
        rest = await held.apart(client.async_put(trajectory(i), partition) for i in range(n, 8))
        await asyncio.sleep(0.05)
        assert held.sends == [1] * n  # the others wait for a put of theirs to end
        held.released.set()
        return list(await asyncio.gather(*first, *rest))

    metas = asyncio.run(go())
    assert held.sends == [1] * n + [8 - n]  # issued in turns apart, sent as one
    assert [len(m) for m in metas] == [1] * 8 and len({m.row_ids[0] for m in metas}) == 8
    got = client.get(partition, ["reward"], 8, "t", timeout=10)
    assert sorted(float(r) for r in got.data["reward"]) == [float(i) for i in range(8)]
    client.ack(got.meta)


def test_a_refused_put_in_flight_lets_the_waiting_ones_go(
    deployment: tuple[str, str], client: tqstream.Client, partition: str, monkeypatch: Any
) -> None:
    n = units(deployment)
    for i in range(n):
        client.put(trajectory(i), partition, keys=[f"taken{i}"])
    held = Held(monkeypatch)

    async def go() -> list[Any]:
        taken = (client.async_put(trajectory(i), partition, keys=[f"taken{i}"]) for i in range(n))
        first = await held.in_flight(taken)
        rest = await held.apart(client.async_put(trajectory(9), partition, keys=[k]) for k in "abc")
        held.released.set()
        return list(await asyncio.gather(*first, *rest, return_exceptions=True))

    out = asyncio.run(go())
    assert all(isinstance(x, DuplicateKeyError) for x in out[:n])
    assert [m.keys for m in out[n:]] == [["a"], ["b"], ["c"]]
    assert held.sends == [1] * n + [3]
    assert sorted(client.list_keys(partition)) == sorted([*"abc", *(f"taken{i}" for i in range(n))])


def test_a_put_cancelled_while_waiting_for_one_in_flight_is_not_made(
    deployment: tuple[str, str], client: tqstream.Client, partition: str, monkeypatch: Any
) -> None:
    held, n = Held(monkeypatch), units(deployment)

    async def go() -> tuple[Any, ...]:
        first = await held.in_flight(
            client.async_put(trajectory(i), partition, keys=[f"k{i}"]) for i in range(n)
        )
        leader, other = await held.apart(
            client.async_put(trajectory(9), partition, keys=[k]) for k in ("x", "y")
        )
        leader.cancel()  # the one that would have sent both
        await asyncio.sleep(0.01)
        held.released.set()
        return tuple(await asyncio.gather(*first, leader, other, return_exceptions=True))

    made = asyncio.run(go())
    leader, other = made[-2:]
    assert all(len(m) == 1 for m in made[:-2])
    assert isinstance(leader, asyncio.CancelledError) and other.keys == ["y"]
    assert held.sends == [1] * n + [1]
    assert sorted(client.list_keys(partition)) == sorted(["y", *(f"k{i}" for i in range(n))])


def rollout(i: int) -> dict[str, Any]:
    """A trajectory with per-token versions: prompt tokens -1, then generated ones (none in
    every fifth, whose row takes the put's ``version``)."""
    prompt, generated = i % 3 + 1, 0 if i % 5 == 0 else i % 4 + 1
    versions = [-1] * prompt + [i % 2 + k for k in range(generated)]
    return {
        "ids": [torch.arange(prompt + generated) + i],
        "versions": [torch.tensor(versions, dtype=torch.int32)],
        "reward": torch.tensor([float(i)]),
        "mask": torch.tensor([[i % 2 == 0, True]]),
    }


def test_puts_encoded_together_store_what_puts_encoded_alone_store(
    deployment: tuple[str, str], client: tqstream.Client, partition: str, monkeypatch: Any
) -> None:
    """A coalescing client encodes the puts it merges as one batch (``deferred.py``); a client
    that does not coalesce encodes each in its call: the rows, their versions and tags are the
    same."""
    from tqstream.client import coalesce

    batches: list[int] = []
    encode = coalesce.encode_batch

    def counted(reqs: Any, inputs: Any) -> Any:
        batches.append(len(inputs))
        return encode(reqs, inputs)

    monkeypatch.setattr(coalesce, "encode_batch", counted)
    stored = {}
    config = ClientConfig(coalesce_window=None)
    with tqstream.connect(deployment[1], config) as alone:
        for name, c in (("together", client), ("alone", alone)):
            part = f"{partition}-{name}"

            async def go(c: tqstream.Client = c, part: str = part) -> list[Any]:
                return await asyncio.gather(
                    *(
                        c.async_put(rollout(i), part, version=10 + i, tags=[{"i": i}])
                        for i in range(24)
                    )
                )

            metas = asyncio.run(go())
            got = c.get(part, ["ids", "versions", "reward", "mask"], 24, "t", timeout=10)
            order = torch.argsort(got.data["reward"]).tolist()
            rows = [got.meta.row_ids[r] for r in order]
            assert sorted(m.row_ids[0] for m in metas) == sorted(rows)
            stored[name] = (
                [got.data["ids"][r].tolist() for r in order],
                [got.data["versions"][r].tolist() for r in order],
                got.data["mask"][order].tolist(),
                [(got.meta.version_start[r], got.meta.version_end[r]) for r in order],
                [got.meta.tags[r] for r in order],
                [(m.version_start, m.tags) for m in metas],
            )
            c.ack(got.meta)
    assert stored["together"] == stored["alone"]
    assert stored["alone"][3][0] == (10, 10) and stored["alone"][3][1] == (1, 2)
    assert sum(batches) >= 20  # all but the first (and any sent alone) encoded in batches


def test_a_bad_put_among_coalesced_ones_fails_in_its_own_call(
    client: tqstream.Client, partition: str, sends: list[int]
) -> None:
    from tqstream.errors import BatchShapeError

    client.put(rollout(0), partition)  # its signature is known: the good ones are deferred
    sends.clear()
    float_versions = {**rollout(1), "versions": [torch.zeros(3)]}
    two_rows = {**rollout(2), "ids": [torch.arange(2), torch.arange(3)]}
    float_ids = {**rollout(3), "ids": [torch.arange(2.0)]}  # refused by the partition

    async def go() -> list[Any]:
        puts = [client.async_put(rollout(i), partition) for i in range(4, 12)]
        puts[2:2] = [client.async_put(d, partition) for d in (float_versions, two_rows, float_ids)]
        return await asyncio.gather(*puts, return_exceptions=True)

    out = asyncio.run(go())
    bad = out[2:5]
    assert isinstance(bad[0], SchemaError) and "versions field 'versions'" in str(bad[0])
    assert isinstance(bad[1], BatchShapeError) and "disagree on the number of rows" in str(bad[1])
    assert all(len(m) == 1 for m in out[:2] + out[5:])
    assert isinstance(bad[2], SchemaError) and "stored as ragged int64" in str(bad[2])
    assert sends == [1, 8]  # the float ids alone (a merge key of their own), then the rest
    assert client.stats(partition).partitions[partition].rows == 1 + 8


def test_a_deferred_put_sent_alone_is_encoded_alone(
    client: tqstream.Client, partition: str, sends: list[int]
) -> None:
    async def go() -> list[Any]:
        return [await client.async_put(rollout(i), partition, version=7) for i in range(3)]

    metas = asyncio.run(go())  # the first learns the signature, the others are deferred
    assert sends == [1, 1, 1]
    assert [(m.version_start, m.version_end) for m in metas] == [([7], [7]), ([1], [2]), ([0], [2])]
    got = client.get(partition, ["ids", "versions"], 3, "t", timeout=10)
    assert sorted(len(r) for r in got.data["ids"]) == [1, 4, 6]


def agent_loop(client: tqstream.Client, partition: str, monkeypatch: Any) -> list[int]:
    """16 rollouts, each ending 0-2 ms after its last put returned (seeded) and putting its
    trajectory, 8 times; each one-exchange put takes 20 ms more, as under a loaded unit. The row
    count of every message sent."""
    sends: list[int] = []
    send = ClientCore._put_direct

    async def slow(core: ClientCore, req: Any, *args: Any) -> Any:
        sends.append(req.n_rows)
        await asyncio.sleep(0.02)
        return await send(core, req, *args)

    monkeypatch.setattr(ClientCore, "_put_direct", slow)

    async def go() -> None:
        ends = random.Random(7)

        async def rollout(t: int) -> None:
            for r in range(8):
                await asyncio.sleep(ends.uniform(0.0, 0.002))
                await client.async_put(trajectory(8 * t + r), partition)

        await asyncio.gather(*(rollout(t) for t in range(16)))

    asyncio.run(go())
    got = client.get(partition, ["reward"], 128, "t", timeout=10)
    assert sorted(float(r) for r in got.data["reward"]) == [float(i) for i in range(128)]
    client.ack(got.meta)
    return sends


def test_rollouts_ending_at_random_times_keep_going_as_one_put(
    deployment: tuple[str, str], client: tqstream.Client, partition: str, monkeypatch: Any
) -> None:
    """The first rollout back after a put returned waits for the others (they were back that
    fast before), instead of going alone and leaving them to wait for it: after the first
    rounds every message carries all 16 (one unit: 9 messages for the 8 rounds; two units: 11-12,
    the first rounds split over both)."""
    sends = agent_loop(client, partition, monkeypatch)
    assert sum(sends) == 128
    assert len(sends) <= 8 + 4 * units(deployment), sends  # slack for a loaded machine


def test_without_waiting_for_them_rollouts_split_into_groups_that_take_turns(
    deployment: tuple[str, str], partition: str, monkeypatch: Any
) -> None:
    """``coalesce_rejoin=0``: the first one back goes alone, the others wait for it, and the two
    groups take turns — 15 messages with one unit, 23-27 with two (what the agent-loop benchmark
    measured at half the rows a second)."""
    with tqstream.connect(deployment[1], ClientConfig(coalesce_rejoin=0)) as c:
        sends = agent_loop(c, partition, monkeypatch)
    assert sum(sends) == 128
    assert len(sends) >= 14, sends
