"""Faults with real processes and real signals: dead clients, lost and revived storage units,
replicated partitions. Every test checks that nothing is lost that need not be (by content), that
what is lost is counted, and that the storage bytes come back to zero."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import tqstream
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol import shm

WORKER = Path(__file__).with_name("fault_client.py")
FAST = tqstream.ClientConfig(connect_timeout=3.0)


def _until(what: Callable[[], bool], limit: float = 10.0) -> float:
    """Seconds until ``what()`` held; fails after ``limit``."""
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < limit, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def cluster() -> Iterator[ProcessCluster]:
    with ProcessCluster(2, storage_max_bytes=200_000) as c:
        yield c


def _client_process(address: str, mode: str, partition: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), address, mode, partition],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def _rows(x: int, n: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(x, x + n, dtype=torch.float32)[:, None].repeat(1, 10)}


# --- dead clients ---
def test_a_dead_clients_parked_get_is_cancelled(cluster: ProcessCluster) -> None:
    with tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"])
        dead = _client_process(cluster.address, "park-get", "p")
        _until(lambda: c.stats("p").partitions["p"].parked_requests == 1)
        _kill(dead)
        _until(lambda: c.stats("p").partitions["p"].parked_requests == 0, 5.0)
        c.put(_rows(0), "p")  # would have been leased to the dead client
        batch = c.get("p", "x", 4, "t", timeout=5)
        assert batch.data["x"][:, 0].tolist() == [0, 1, 2, 3]


def test_a_dead_clients_lease_is_released_at_once(cluster: ProcessCluster) -> None:
    with tqstream.connect(cluster.address, FAST) as c:
        c.put(_rows(0), "p")
        dead = _client_process(cluster.address, "lease", "p")
        assert c.stats("p").partitions["p"].tasks["t"].leased == 4
        _kill(dead)
        # the lease had 300 s to run: the rows come back because the connection dropped
        batch = c.get("p", "x", 4, "t", timeout=5)
        assert sorted(batch.data["x"][:, 0].tolist()) == [0, 1, 2, 3]
        batch.ack()
        t = c.stats("p").partitions["p"].tasks["t"]
        assert (t.available, t.leased, t.acked) == (0, 0, 4)


def test_a_dead_producers_slots_come_back(cluster: ProcessCluster) -> None:
    with tqstream.connect(cluster.address, FAST) as c:
        adm = c.admission("slots", name="adm", max_pending_slots=2, max_version_slots=100)
        dead = _client_process(cluster.address, "slots", "p")
        assert adm.state()["running"] == 2 and adm.try_acquire(1) == []
        _kill(dead)
        ids = adm.acquire(2, timeout=5)  # capacity is not shrunk for good
        assert len(ids) == 2
        assert adm.state()["rejected"] == 2  # the dead producer's, released as rejected


def test_a_freed_slot_is_not_granted_to_a_dead_producers_parked_acquire(
    cluster: ProcessCluster,
) -> None:
    with tqstream.connect(cluster.address, FAST) as c:
        adm = c.admission("slots", name="adm", max_pending_slots=2, max_version_slots=100)
        mine = adm.acquire(2, timeout=5)
        dead = _client_process(cluster.address, "park-acquire", "p")
        _kill(dead)
        time.sleep(0.5)  # the disconnect reaches the controller
        adm.release(mine[:1])
        assert len(adm.acquire(1, timeout=5)) == 1  # the freed slot came to a live producer
        assert adm.state()["running"] == 2


def test_room_freed_under_a_quota_is_not_kept_for_a_dead_producers_put(
    cluster: ProcessCluster,
) -> None:
    with tqstream.connect(cluster.address, FAST) as c:
        for i in range(10):  # 10 x 40 kB: the two units' 2 x 200 kB quotas are full
            c.put({"x": torch.full((4, 2500), float(i))}, "full")
        with pytest.raises(tqstream.CapacityError):
            c.put({"x": torch.zeros(4, 1000)}, "p", timeout=0)
        dead = _client_process(cluster.address, "wait-put", "p")  # waits for room
        _kill(dead)
        time.sleep(0.5)
        c.clear_partition("full")
        t0 = time.monotonic()
        c.put({"x": torch.zeros(4, 1000)}, "p", timeout=5)
        assert time.monotonic() - t0 < 2
        st = c.stats()
        assert st.partitions["p"].rows == 4  # the dead producer's put never landed


def test_a_lease_outlives_the_thread_lane_that_took_it(cluster: ProcessCluster) -> None:
    """A client's connections (one per calling thread) are one session: a thread that took a
    lease and ended closes its connection, but the client lives on, so the lease stays."""
    with tqstream.connect(cluster.address, FAST) as c:
        c.put(_rows(0), "p")
        taken: list[tqstream.BatchMeta] = []
        worker = threading.Thread(target=lambda: taken.append(c.get_meta("p", "x", 4, "t")))
        worker.start()
        worker.join()
        other = threading.Thread(target=lambda: c.stats())  # its lane closes the dead thread's
        other.start()
        other.join()
        time.sleep(1.0)
        assert c.stats("p").partitions["p"].tasks["t"].leased == 4
        assert c.ack(taken[0]) == 4


# --- lost units ---
def _fill(c: tqstream.Client, partition: str, puts: int, first: int = 0) -> dict[int, set[float]]:
    """``puts`` puts of 4 rows each, row values distinct; returns unit -> the values it holds."""
    held: dict[int, set[float]] = {}
    for i in range(puts):
        rows = _rows(first + 4 * i)
        meta = c.put(rows, partition)
        for u, v in zip(meta.units, rows["x"][:, 0].tolist(), strict=True):
            held.setdefault(u, set()).add(v)
    return held


def _drain(c: tqstream.Client, partition: str, n: int) -> list[float]:
    """Get (and ack) ``n`` rows for task t; check each row is intact."""
    seen: list[float] = []
    while len(seen) < n:
        batch = c.get(partition, "x", min(4, n - len(seen)), "t", timeout=5)
        x = batch.data["x"]
        assert torch.equal(x, x[:, :1].repeat(1, 10))
        seen += x[:, 0].tolist()
        batch.ack()
    return seen


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _proc_of(cluster: ProcessCluster, c: tqstream.Client, unit: int) -> int:
    """The index in ``cluster.unit_addresses`` of the controller's unit ``unit``."""
    return cluster.unit_addresses.index(c.stats().units[unit].address)


def test_a_killed_unit_is_detected_its_rows_counted_lost_and_the_rest_served() -> None:
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        held = _fill(c, "p", 8)
        assert sorted(len(v) for v in held.values()) == [16, 16]  # puts alternate units
        leased = c.get_meta("p", "x", 32, "peek")  # another task holds every row, unacked
        victim = 1
        cluster.procs[1 + _proc_of(cluster, c, victim)].kill()
        took = _until(lambda: not c.stats().units[victim].alive, 5.0)
        t0 = time.monotonic()
        st = c.stats("p")
        assert time.monotonic() - t0 < 1.0  # stats answer at once with a dead unit
        p = st.partitions["p"]
        assert (p.lost, p.rows) == (16, 16)
        assert p.tasks["peek"].lost == 16 and p.tasks["t"].lost == 16  # t is registered
        assert st.units[victim].alive is False
        values = _drain(c, "p", 16)
        assert sorted(values) == sorted(held[1 - victim])  # the survivors, each once
        with pytest.raises(tqstream.RequestTimeoutError):
            c.get_meta("p", "x", 1, "t", timeout=0.2)
        # the survivors were freed once t (the registered task) acked them, the lost rows are
        # gone: nothing of the lease is left, and acking it is harmless
        assert c.ack(leased) == 0
        for i in range(6):  # new puts all go to the live unit
            assert set(c.put(_rows(100 + 4 * i), "q").units) == {1 - victim}
        c.clear_partition("q")
        _until(lambda: c.stats().storage_bytes == 0, 5.0)  # p's rows were acked by t: freed
        print(f"unit loss detected in {took:.2f}s")


def test_a_small_put_to_a_frozen_unit_fails_naming_it_and_the_next_avoids_it() -> None:
    fast = tqstream.ClientConfig(connect_timeout=2.0, heartbeat_interval=0.2)
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, fast) as c:
        for i in range(2):  # the client's connection to each unit is open
            c.put(_rows(4 * i), "p")
        pid = cluster.procs[1 + _proc_of(cluster, c, 1)].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            errors = []
            for i in range(2):  # small puts go to the units in turn: one to the frozen one
                try:
                    c.put(_rows(100 + 4 * i), "p")
                except tqstream.UnitLostError as exc:
                    errors.append(str(exc))
            assert len(errors) == 1
            assert re.search(r"storage unit 1 at tcp://\S+ did not take a put of 4 rows", errors[0])
            assert "avoids the unit" in errors[0]
            for i in range(4):  # the client avoids it now: every put lands on the other unit
                assert set(c.put(_rows(200 + 4 * i), "p").units) == {0}
        finally:
            os.kill(pid, signal.SIGCONT)


def test_a_direct_put_through_shared_memory_to_a_frozen_unit_leaves_nothing_behind() -> None:
    """The client of a put whose unit froze removes its segment; the unit, thawed, finds no
    segment for the put it had queued, refuses it and stores nothing: no segment is orphaned and
    the rows put before are intact."""
    fast = tqstream.ClientConfig(
        connect_timeout=2.0, heartbeat_interval=0.2, shared_memory_min_bytes=0
    )
    with ProcessCluster(1) as cluster, tqstream.connect(cluster.address, fast) as c:
        c.put(_rows(0), "p")
        pid = cluster.procs[1].pid
        (token,) = (  # the unit's, from its probe (token pid ...)
            n[4:20]
            for n in os.listdir(shm.SHM_DIR)
            if n.endswith("-probe") and _read(f"{shm.SHM_DIR}/{n}").split()[1] == str(pid)
        )

        def shm_names(kind: str) -> set[str]:
            return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"tqs-{token}-{kind}")}

        assert len(shm_names("c")) == 1
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(tqstream.UnitLostError, match="did not take a put of 4 rows"):
                c.put(_rows(100), "p")
            assert shm_names("d") == set()
        finally:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: c.stats().units[0].alive, 10.0)
        c.put(_rows(200), "p")  # the unit served the frozen put's refusal before this one
        assert c.stats("p").partitions["p"].rows == 8
        assert len(shm_names("c")) == 2
        assert shm_names("d") == shm_names("l") == set()
        got = c.get("p", "x", batch_size=8, task="t", timeout=10).data["x"][:, 0]
        assert sorted(got.tolist()) == [0, 1, 2, 3, 200, 201, 202, 203]


def test_a_restarted_unit_registers_again_and_takes_new_rows() -> None:
    # puts placed by the controller (a small put goes straight to a unit this client can reach,
    # and its connection to the restarted unit may take a moment longer to come back)
    placed = tqstream.ClientConfig(connect_timeout=3.0, direct_put_bytes=0)
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, placed) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        held = _fill(c, "p", 4)
        i = _proc_of(cluster, c, 0)
        address = cluster.unit_addresses[i]
        cluster.procs[1 + i].kill()
        _until(lambda: not c.stats().units[0].alive, 5.0)
        assert cluster.restart_unit(i) == address
        _until(lambda: c.stats().units[0].alive, 10.0)
        assert c.stats("p").partitions["p"].lost == 8
        c.create_partition("new", ["x"], tasks=["t"])
        fresh = _fill(c, "new", 8, first=1000)
        assert len(fresh) == 2  # it takes rows again (more of them: it was the emptier one)
        assert sorted(_drain(c, "new", 32)) == [float(v) for v in range(1000, 1032)]
        assert sorted(_drain(c, "p", 8)) == sorted(held[1])
        _until(lambda: c.stats().storage_bytes == 0, 5.0)


def test_a_frozen_unit_is_lost_after_missed_heartbeats_and_revives_empty() -> None:
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        held = _fill(c, "p", 4)
        pid = cluster.procs[1 + _proc_of(cluster, c, 1)].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            took = _until(lambda: not c.stats().units[1].alive, 10.0)
            assert 1.0 < took < 8.0  # three heartbeat intervals: not at once, not never
        finally:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: c.stats().units[1].alive, 10.0)
        # the controller gave its rows up, so the revived unit dropped them: no orphan bytes
        _until(lambda: c.stats().units[1].bytes == 0, 5.0)
        assert c.stats("p").partitions["p"].lost == 8
        assert sorted(_drain(c, "p", 8)) == sorted(held[0])
        _until(lambda: c.stats().storage_bytes == 0, 5.0)


# --- replicas ---
@pytest.mark.parametrize("row_floats", [10, 100_000], ids=["frames", "shared-memory"])
def test_with_two_replicas_a_killed_unit_loses_nothing(row_floats: int) -> None:
    with ProcessCluster(3) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"], replicas=2)
        values = []
        for i in range(12):
            x = torch.arange(4 * i, 4 * i + 4, dtype=torch.float32)[:, None].repeat(1, row_floats)
            meta = c.put({"x": x}, "p")
            assert len(meta.replicas) == 4 and all(
                r >= 0 and r != u for r, u in zip(meta.replicas, meta.units, strict=True)
            )
            values += x[:, 0].tolist()
        in_flight = c.get_meta("p", "x", 8, "t")  # leased before the loss, read after it
        victim = in_flight.units[0]
        cluster.procs[1 + _proc_of(cluster, c, victim)].kill()
        got = c.get_data(in_flight)["x"]  # from the replicas: the consumer does not notice
        assert got[:, 0].tolist() == [float(v) for v in range(8)]
        c.ack(in_flight)
        _until(lambda: not c.stats().units[victim].alive, 5.0)
        seen = [float(v) for v in range(8)]
        while len(seen) < 48:
            batch = c.get("p", "x", 8, "t", timeout=5)
            x = batch.data["x"]
            assert torch.equal(x, x[:, :1].repeat(1, row_floats))
            seen += x[:, 0].tolist()
            batch.ack()
        assert sorted(seen) == sorted(values)  # every row exactly once
        p = c.stats("p").partitions["p"]
        assert p.lost == 0 and p.replicas == 2
        _until(lambda: c.stats().storage_bytes == 0, 5.0)  # both copies freed


def test_a_put_of_two_copies_goes_to_both_units_in_one_exchange(monkeypatch) -> None:
    """Small puts to a partition of two copies go to two units at once (no placement by the
    controller: prepare, store, commit), sync and concurrent async ones alike."""
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["id"], tasks=["t"], replicas=2)

        async def placed(*args: object) -> None:
            raise AssertionError("a small put of two copies was placed by the controller")

        monkeypatch.setattr(c._core, "_put_placed", placed)
        for i in range(8):
            meta = c.put({"id": torch.arange(4 * i, 4 * i + 4)}, "p")
            assert all(r >= 0 and r != u for r, u in zip(meta.replicas, meta.units, strict=True))

        async def many() -> None:
            await asyncio.gather(*(c.async_put({"id": torch.tensor([i])}, "p")
                                   for i in range(32, 96)))  # fmt: skip

        asyncio.run(many())
        assert sum(u.rows for u in c.stats().units) == 2 * 96  # every row on both units
        seen: list[int] = []
        while len(seen) < 96:
            batch = c.get("p", "id", 32, "t", timeout=5)
            seen += batch.data["id"].tolist()
            batch.ack()
        assert sorted(seen) == list(range(96))
        c.clear_partition("p")
        _until(lambda: c.stats().storage_bytes == 0, 5.0)


def test_a_partition_re_created_with_one_copy_is_put_once_again() -> None:
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], replicas=2)
        assert c.put({"x": torch.zeros(2)}, "p").replicas  # the client learns: pairs
        c.clear_partition("p")
        c.create_partition("p", ["x"])
        assert not c.put({"x": torch.zeros(3)}, "p").replicas  # one copy again
        assert sum(u.rows for u in c.stats().units) == 3
        c.clear_partition("p")
        c.create_partition("p", ["x"], replicas=2)
        assert c.put({"x": torch.zeros(3)}, "p").replicas


def test_a_unit_killed_amid_puts_of_two_copies_loses_nothing_and_stores_nothing_twice() -> None:
    """A producer puts rows 0..N-1 one put at a time, each retried until it is made; a unit is
    SIGKILLed halfway. Every row is read exactly once: a put that failed (its copy's unit gone
    before the commit) stored nothing, one that was made is not made again, none is lost."""
    n = 60
    with ProcessCluster(2) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["id"], tasks=["t"], replicas=2)
        for i in range(n):
            if i == n // 2:
                cluster.procs[2].kill()
            while True:
                try:
                    c.put({"id": torch.tensor([i, i])}, "p")
                    break
                except (tqstream.UnitLostError, tqstream.RequestTimeoutError):
                    continue  # nothing was stored: put it again
        seen: list[int] = []
        while len(seen) < 2 * n:
            batch = c.get("p", "id", 8, "t", timeout=10)
            seen += batch.data["id"].tolist()
            batch.ack()
        assert sorted(seen) == sorted(list(range(n)) * 2)
        assert c.stats("p").partitions["p"].lost == 0
        assert c.stats("p").partitions["p"].tasks["t"].available == 0  # nothing more


def test_fields_added_and_replaced_later_are_kept_twice_too() -> None:
    """put_fields and keyed writes store on the row's replica as well: after the loss of the
    primary unit the added and the replaced fields are read from the copies."""
    with ProcessCluster(3) as cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", replicas=2)
        meta = c.put({"x": torch.arange(6, dtype=torch.float32)}, "p", keys=list("abcdef"))
        c.put_fields(meta, {"adv": torch.full((6,), 2.0)})
        c.put_by_keys("p", list("abc"), {"x": torch.full((3,), -1.0)}, tags=[{"v": 1}] * 3)
        victim = meta.units[0]
        cluster.procs[1 + _proc_of(cluster, c, victim)].kill()
        _until(lambda: not c.stats().units[victim].alive, 5.0)
        got = c.get_by_keys("p", list("abcdef"), ["x", "adv"]).data
        assert got["x"].tolist() == [-1.0, -1.0, -1.0, 3.0, 4.0, 5.0]
        assert got["adv"].tolist() == [2.0] * 6
        assert c.stats("p").partitions["p"].lost == 0


def test_replicas_are_refused_out_of_range() -> None:
    with tqstream.init() as c, pytest.raises(tqstream.InvalidRequestError, match="replicas"):
        c.create_partition("p", ["x"], replicas=3)


# --- the launcher ---
def _launch(*flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tqstream.launch.processes", "--storage-units", "2", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("tqstream ready at "), line
    return proc, line.split()[3]


def _unit_pids(launcher: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(launcher), "-f", "tqstream.launch.worker storage"],
        capture_output=True,
        text=True,
    ).stdout
    return [int(x) for x in out.split()]


def test_the_launcher_restarts_a_dead_unit_by_default() -> None:
    proc, address = _launch()
    placed = tqstream.ClientConfig(connect_timeout=3.0, direct_put_bytes=0)
    try:
        with tqstream.connect(address, placed) as c:
            c.put(_rows(0), "p")
            os.kill(_unit_pids(proc.pid)[0], signal.SIGKILL)
            _until(lambda: len(_unit_pids(proc.pid)) == 2 and all(
                u.alive for u in c.stats().units
            ), 30.0)  # fmt: skip
            for i in range(4):
                c.put(_rows(4 * i), "q")  # both units take rows again
            assert all(u.rows > 0 for u in c.stats().units if u.rows >= 0)
            assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "restarted at" in err


def test_the_launcher_stops_when_told_to_on_a_unit_exit() -> None:
    proc, _ = _launch("--on-unit-exit", "stop")
    os.kill(_unit_pids(proc.pid)[0], signal.SIGKILL)
    assert proc.wait(timeout=30) == 1
    _, err = proc.communicate()
    assert "shutting down" in err
