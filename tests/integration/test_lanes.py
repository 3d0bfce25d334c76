"""Calls of a client of other processes run on the caller's thread (sync) or event loop (async),
on connections of their own (``client/lanes.py``); an embedded client, sync calls made inside a
running event loop and loops that cannot watch file descriptors use the IO thread."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

import tqstream
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol.transport import _OWNED


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with ProcessCluster(1) as cluster:
        yield cluster.address


def lanes_of(client: tqstream.Client) -> dict[threading.Thread, object]:
    assert client._lanes is not None
    return dict(client._lanes._lanes)


def loop_lanes_of(client: tqstream.Client) -> dict[asyncio.AbstractEventLoop, object]:
    assert client._lanes is not None
    return dict(client._lanes._loop_lanes)


async def async_roundtrip(client: tqstream.Client, partition: str, n: int) -> None:
    for i in range(n):
        await client.async_put({"x": torch.full((4, 3), float(i))}, partition)
        batch = await client.async_get(partition, "x", 4, "t", timeout=10)
        assert torch.equal(batch.data["x"], torch.full((4, 3), float(i)))
        assert await client.async_ack(batch.meta) == 4


def roundtrip(client: tqstream.Client, partition: str, n: int) -> None:
    for i in range(n):
        client.put({"x": torch.full((4, 3), float(i))}, partition)
        batch = client.get(partition, "x", 4, "t", timeout=10)
        assert torch.equal(batch.data["x"], torch.full((4, 3), float(i)))
        assert client.ack(batch.meta) == 4


def test_each_thread_calls_on_its_own_connections(address: str) -> None:
    with tqstream.connect(address) as client:
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                roundtrip(client, f"lanes-{k}", 20)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        lanes = lanes_of(client)
        assert set(lanes) == set(threads)
        assert len({id(lane.core) for lane in lanes.values()}) == 4  # type: ignore[attr-defined]
        # the next thread's first call closes the lanes of the threads that are gone
        later = threading.Thread(target=roundtrip, args=(client, "lanes-later", 1))
        later.start()
        later.join(60)
        assert set(lanes_of(client)) == {later}
        for lane in lanes.values():
            assert lane.ctx.closed  # type: ignore[attr-defined]


def test_close_from_another_thread_interrupts_a_blocked_call(address: str) -> None:
    client = tqstream.connect(address)
    client.create_partition("lanes-block", ["x"])
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            client.get_meta("lanes-block", "x", 1, "t")  # nothing comes: waits until closed
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    client.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert time.monotonic() - t0 < 5
    assert len(raised) == 1 and isinstance(raised[0], tqstream.ClosedError)
    assert not lanes_of(client)
    with pytest.raises(tqstream.ClosedError, match="closed"):
        client.stats()


def test_sync_call_inside_a_running_loop_goes_through_the_io_thread(address: str) -> None:
    with tqstream.connect(address) as client:

        async def main() -> None:
            roundtrip(client, "lanes-in-loop", 2)  # blocks this loop, but works

        asyncio.run(main())
        assert threading.current_thread() not in lanes_of(client)
        roundtrip(client, "lanes-in-loop", 1)
        assert threading.current_thread() in lanes_of(client)


def test_keyboard_interrupt_leaves_the_lane_usable(address: str) -> None:
    assert threading.current_thread() is threading.main_thread()
    # a run started with SIGINT ignored (``nohup ... &``) would never see the signal: Python's
    # own handler (KeyboardInterrupt) for the duration of the test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_get(address)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_get(address: str) -> None:
    with tqstream.connect(address) as client:
        client.create_partition("lanes-int", ["x"], tasks=["t"])
        timer = threading.Timer(
            0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)
        )
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            client.get_meta("lanes-int", "x", 1, "t", lease_timeout=1.0)
        timer.join()
        # the interrupted request is gone; the same thread's next calls work
        roundtrip(client, "lanes-int", 2)


def test_embedded_client_has_no_lanes() -> None:
    with tqstream.init(storage_units=1) as client:
        assert client._lanes is None
        roundtrip(client, "lanes-embedded", 1)


def test_async_calls_run_on_the_callers_loop(address: str) -> None:
    with tqstream.connect(address) as client:
        loops = []

        async def main() -> None:
            loops.append(asyncio.get_running_loop())
            # concurrent coroutines of one loop share its lane
            await asyncio.gather(*(async_roundtrip(client, f"loop-{k}", 5) for k in range(4)))
            assert list(loop_lanes_of(client)) == [loops[-1]]

        asyncio.run(main())
        first = loop_lanes_of(client)[loops[0]]
        core = first._opening.result()  # type: ignore[attr-defined]
        # a new loop (e.g. one asyncio.run per step) takes over the ended loop's connections
        asyncio.run(main())
        assert loop_lanes_of(client) == {loops[1]: first}
        assert first._opening.result() is core  # type: ignore[attr-defined]
        assert not first.ctx.closed  # type: ignore[attr-defined]
        assert not lanes_of(client)  # no sync call was made


def test_lanes_of_ended_loops_beyond_the_one_taken_over_are_closed(address: str) -> None:
    with tqstream.connect(address) as client:
        loops = [asyncio.new_event_loop() for _ in range(3)]
        loops[0].run_until_complete(async_roundtrip(client, "loop-ended-0", 1))
        # the second loop ends with a get still waiting at the controller
        client.create_partition("loop-ended-1", ["x"])
        waiting = loops[1].create_task(client.async_get_meta("loop-ended-1", "x", 1, "t"))
        loops[1].run_until_complete(asyncio.sleep(0.3))
        assert not waiting.done()
        waiting._log_destroy_pending = False  # type: ignore[attr-defined]  # dies with its loop
        lanes = [loop_lanes_of(client)[loop] for loop in loops[:2]]
        for loop in loops[:2]:
            loop.close()
        try:
            loops[2].run_until_complete(async_roundtrip(client, "loop-ended-2", 1))
        finally:
            loops[2].close()
        assert loop_lanes_of(client) == {loops[2]: lanes[0]}
        assert lanes[1].ctx.closed  # type: ignore[attr-defined]


def test_close_from_another_thread_fails_a_waiting_async_call(address: str) -> None:
    client = tqstream.connect(address)
    client.create_partition("loop-block", ["x"])
    raised: list[BaseException] = []

    async def wait() -> None:
        try:
            await client.async_get_meta("loop-block", "x", 1, "t")
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=asyncio.run, args=(wait(),))
    waiter.start()
    time.sleep(0.5)
    client.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], tqstream.ClosedError)


def test_close_inside_a_coroutine(address: str) -> None:
    client = tqstream.connect(address)

    async def main() -> None:
        await async_roundtrip(client, "loop-close", 1)
        lane = loop_lanes_of(client)[asyncio.get_running_loop()]
        client.close()
        assert lane.ctx.closed  # type: ignore[attr-defined]
        with pytest.raises(tqstream.ClosedError):
            await client.async_stats()

    asyncio.run(main())


class NoReaderLoop(asyncio.SelectorEventLoop):
    """A loop that cannot watch file descriptors (like Windows' proactor loop)."""

    def add_reader(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError


def test_loop_without_add_reader_uses_the_io_thread(address: str) -> None:
    with tqstream.connect(address) as client:
        loop = NoReaderLoop()
        try:
            loop.run_until_complete(async_roundtrip(client, "loop-noreader", 2))
            assert loop_lanes_of(client)[loop].unsupported  # type: ignore[attr-defined]
        finally:
            loop.close()


def test_a_failed_get_on_a_lane_gives_its_lease_back() -> None:
    """The fetch of a sync get fails (one of its storage units froze): the lease is released
    through the IO thread at once, not at the lane's next call or at lease expiry."""
    with ProcessCluster(2) as cluster:
        cfg = tqstream.ClientConfig(connect_timeout=2.0, heartbeat_interval=0.2)
        with tqstream.connect(cluster.address, cfg) as client:
            for _ in range(2):  # small puts go to the units in turn: one on each
                client.put({"x": torch.arange(4)}, "dead-unit")
            assert sorted(u.rows for u in client.stats().units) == [4, 4]
            frozen = cluster.procs[2]
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                with pytest.raises(tqstream.UnitLostError, match=r"storage unit \d at "):
                    client.get("dead-unit", "x", 8, "t", lease_timeout=300)
                # the rows are available to the task again long before the lease would expire
                # (asked by another client: this thread's lane does not run until its next call)
                with tqstream.connect(cluster.address, cfg) as other:
                    meta = other.get_meta("dead-unit", "x", 4, "t", timeout=5)
                    assert len(meta) == 4
            finally:
                os.kill(frozen.pid, signal.SIGCONT)


# A sync call's request waits for its reply on the caller's thread, polling its sockets (no loop
# runs): the failures the loop's timers and readers catch are caught there too.
def test_sync_request_to_a_frozen_server_times_out() -> None:
    with ProcessCluster(1) as cluster:
        cfg = tqstream.ClientConfig(request_timeout=0.5, heartbeat_interval=30.0)
        with tqstream.connect(cluster.address, cfg) as client:
            client.create_partition("frozen", ["x"])
            os.kill(cluster.procs[0].pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(tqstream.RequestTimeoutError, match=r"within 0.5s"):
                    client.list_keys("frozen")
                assert time.monotonic() - t0 < 3
            finally:
                os.kill(cluster.procs[0].pid, signal.SIGCONT)
            assert client.list_keys("frozen") == []  # the late reply is dropped, the lane works


def test_sync_request_notices_a_frozen_server_by_its_heartbeats() -> None:
    with ProcessCluster(1) as cluster:
        cfg = tqstream.ClientConfig(heartbeat_interval=0.2)
        with tqstream.connect(cluster.address, cfg) as client:
            client.create_partition("silent", ["x"])
            os.kill(cluster.procs[0].pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(tqstream.ConnectionLostError, match="list_keys"):
                    client.list_keys("silent")
                assert time.monotonic() - t0 < 5
            finally:
                os.kill(cluster.procs[0].pid, signal.SIGCONT)


def test_sync_request_during_an_outage_waits_at_most_connect_timeout() -> None:
    with ProcessCluster(1) as cluster:
        cfg = tqstream.ClientConfig(connect_timeout=1.0)
        with tqstream.connect(cluster.address, cfg) as client:
            client.create_partition("outage", ["x"])
            cluster.procs[0].kill()
            cluster.procs[0].wait()
            time.sleep(0.3)  # the drop reaches the lane's monitor (taken in at the next call)
            t0 = time.monotonic()
            with pytest.raises(tqstream.ConnectionLostError, match=r"within 1.0s"):
                client.list_keys("outage")
            assert time.monotonic() - t0 < 1.0 + 2


def test_a_forked_child_never_tears_down_the_parents_sockets(address: str) -> None:
    """A DataLoader worker or multiprocessing child inherits the client's ZMQ objects; dropping
    them there (garbage collection) must not close the parent's live sockets."""
    import gc
    import os

    with tqstream.connect(address) as client:
        roundtrip(client, "lanes-fork", 1)
        pid = os.fork()
        if pid == 0:  # the child: drop every inherited reference, collect, leave
            code = 2  # anything that goes wrong in the child fails the test
            try:
                code = 0
                for obj in gc.get_objects():  # tqstream's own (other libraries' are theirs)
                    if isinstance(obj, zmq.Socket) and not obj.closed and obj in _OWNED:
                        code |= 0 if obj._shadow else 1
                        obj.__del__()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # every inherited socket was a shadow
        roundtrip(client, "lanes-fork", 2)  # the parent's connections still work
