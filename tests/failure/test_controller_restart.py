"""A controller with a journal dies (SIGKILL) and is started again at its address: nothing a client
was told is lost, leases keep their deadlines, requests in flight wait and are carried out once,
and what cannot be recovered (a unit that died meanwhile) is counted, not silently dropped."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq.asyncio

import tqstream
from tqstream.controller.service import ControllerService
from tqstream.convert.inputs import columns_from_data
from tqstream.errors import JournalClusterError
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import (
    PROTOCOL_VERSION,
    GetMeta,
    Hello,
    MetaReply,
    Ok,
    Store,
    Welcome,
    decode_reply,
    encode,
)
from tqstream.protocol.wire import columns_to_wire

FAST = tqstream.ClientConfig(connect_timeout=3.0, reconnect_timeout=30.0)


def _rows(x: int, n: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(x, x + n, dtype=torch.float32)[:, None].repeat(1, 3)}


@pytest.fixture(params=[("batched", 200_000), ("sync", 8)], ids=["batched", "sync-snapshots"])
def durable(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ProcessCluster]:
    """A cluster whose controller has a journal; ``sync-snapshots``: fsynced, and a snapshot
    every 8 records, so a restart reads a snapshot and the records after it."""
    durability, every = request.param
    journal = str(tmp_path / "journal")
    with ProcessCluster(2, durability=durability, journal=journal, snapshot_records=every) as c:
        yield c


def _restart(cluster: ProcessCluster) -> None:
    cluster.procs[0].kill()
    cluster.procs[0].wait()
    cluster.restart_controller()


def test_a_killed_controller_restarts_with_every_row_lease_and_ack(
    durable: ProcessCluster,
) -> None:
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["a", "b"])
        for i in range(6):
            c.put(_rows(4 * i), "p")
        acked = c.get("p", "x", 4, "a", timeout=5)
        acked.ack()
        held = c.get("p", "x", 4, "a", timeout=5)  # leased across the restart
        _restart(durable)
        held.ack()  # the lease survived: acked, not refused
        seen = acked.data["x"][:, 0].tolist() + held.data["x"][:, 0].tolist()
        while len(seen) < 24:
            batch = c.get("p", "x", 4, "a", timeout=5)
            seen += batch.data["x"][:, 0].tolist()
            batch.ack()
        assert sorted(seen) == [float(x) for x in range(24)]  # each row once
        other = c.get("p", "x", 24, "b", timeout=5)  # the other task lost nothing either
        assert sorted(other.data["x"][:, 0].tolist()) == [float(x) for x in range(24)]
        stats = c.stats("p").partitions["p"]
        assert stats.rows == 24 and stats.lost == 0
        assert stats.tasks["a"].consumed == 24


def test_a_get_waiting_while_the_controller_is_down_is_answered_after_the_restart(
    durable: ProcessCluster,
) -> None:
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"])
        got: list[object] = []
        waiter = threading.Thread(
            target=lambda: got.append(c.get("p", "x", 4, "t", timeout=30)), daemon=True
        )
        waiter.start()
        time.sleep(0.5)  # parked at the controller
        _restart(durable)
        c.put(_rows(0), "p")
        waiter.join(20)
        assert got, "the parked get was not answered after the restart"
        batch = got[0]
        assert batch.data["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]  # type: ignore[attr-defined]
        batch.ack()  # type: ignore[attr-defined]
        assert c.stats("p").partitions["p"].tasks["t"].consumed == 4


class _Producer:
    """A thread putting 4 rows at a time, without pause, until ``stop()``: ``put`` holds the
    rows of every put that returned, ``errors`` what failed."""

    def __init__(self, address: str) -> None:
        self.put: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        with tqstream.connect(address, FAST) as p:
            i = 0
            while not self._stop.is_set():
                try:
                    p.put(_rows(4 * i), "p")
                except BaseException as exc:
                    self.errors.append(exc)
                    return
                self.put.extend(range(4 * i, 4 * i + 4))
                i += 1

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors
        return self.put


def _put_through_restarts(cluster: ProcessCluster, kills: int) -> list[int]:
    """The rows of every put a producer got an answer for while the controller was killed
    ``kills`` times, 0.7 s apart."""
    producer = _Producer(cluster.address)
    for _ in range(kills):
        time.sleep(0.7)
        _restart(cluster)
    time.sleep(0.5)
    return producer.stop()


def _read_all(c: tqstream.Client, n: int) -> list[float]:
    seen: list[float] = []
    while len(seen) < n:
        batch = c.get("p", "x", min(64, n - len(seen)), "t", timeout=5)
        seen += batch.data["x"][:, 0].tolist()
        batch.ack()
    return seen


def test_puts_keep_going_through_restarts(durable: ProcessCluster) -> None:
    """A producer puts without pause while the controller is killed twice: every put that
    returned is read exactly once."""
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"])
        put = _put_through_restarts(durable, 2)
        seen = _read_all(c, len(put))
        assert sorted(seen) == [float(x) for x in sorted(put)]  # none twice, none missing
        assert c.stats("p").partitions["p"].rows == len(put)


def test_paired_puts_cut_by_kills_leave_each_row_twice_or_not_at_all(tmp_path: Path) -> None:
    """With two copies a small put goes to both units in one exchange each (a paired put), the
    controller committing it once both stored their copy. Killed again and again in the middle
    of them: every put that returned is read exactly once; each unit holds exactly those rows
    (a put cut in half is rolled back on both); a unit killed afterwards loses none of them."""
    journal = str(tmp_path / "journal")
    with (
        ProcessCluster(2, durability="batched", journal=journal, replicas=2) as cluster,
        tqstream.connect(cluster.address, FAST) as c,
    ):
        c.create_partition("p", ["x"], tasks=["t"])
        put = _put_through_restarts(cluster, 3)
        assert len(put) > 40
        deadline = time.monotonic() + 15  # a put rolled back frees its copy in the background
        while [u.rows for u in c.stats().units] != [len(put)] * 2:
            assert time.monotonic() < deadline, (c.stats().units, len(put))
            time.sleep(0.2)
        cluster.procs[1].kill()  # storage unit 0
        cluster.procs[1].wait()
        seen = _read_all(c, len(put))
        assert sorted(seen) == [float(x) for x in sorted(put)]
        stats = c.stats("p").partitions["p"]
        assert (stats.produced, stats.lost) == (len(put), 0)


def test_a_unit_that_dies_while_the_controller_is_down_is_counted_lost(
    durable: ProcessCluster,
) -> None:
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"])
        for i in range(8):
            c.put(_rows(4 * i), "p")
        durable.procs[0].kill()
        durable.procs[0].wait()
        durable.procs[1].kill()  # unit 0, while nobody watches
        durable.procs[1].wait()
        durable.restart_controller()
        stats = c.stats("p").partitions["p"]
        assert stats.lost > 0 and stats.rows + stats.lost == 32
        seen: list[float] = []
        while len(seen) < stats.rows:
            batch = c.get("p", "x", 4, "t", timeout=5)
            seen += batch.data["x"][:, 0].tolist()
            batch.ack()
        assert len(set(seen)) == len(seen) == stats.rows


def test_a_journal_of_another_cluster_is_refused_naming_both(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    config = tqstream.ControllerConfig(durability="batched", journal=str(journal))
    ControllerService(config).durable.close()  # type: ignore[union-attr]
    (journal / "cluster").write_text("0123456789abcdef\n")
    with pytest.raises(JournalClusterError, match="0123456789abcdef"):
        ControllerService(config)


def test_a_snapshot_that_names_a_function_is_refused(tmp_path: Path) -> None:
    """Loading a snapshot builds tqstream's classes and containers only: one that would call
    something else (here ``os.system``) is refused as damaged, and nothing runs."""
    import pickle

    from tqstream.controller import journalfile
    from tqstream.controller.durable import cluster_of
    from tqstream.errors import JournalCorruptError

    journal = tmp_path / "journal"
    config = tqstream.ControllerConfig(durability="batched", journal=str(journal))
    ControllerService(config).durable.close()  # type: ignore[union-attr]
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    journalfile.write_snapshot(str(journal), cluster_of(str(journal)), 0, pickle.dumps(Evil()))
    with pytest.raises(JournalCorruptError, match=r"posix\.system|os\.system"):
        ControllerService(config).durable.restored()  # type: ignore[union-attr]
    assert not marker.exists()


def test_a_journal_needs_a_directory() -> None:
    with pytest.raises(tqstream.ConfigError, match="journal"):
        tqstream.ControllerConfig(durability="sync")
    with pytest.raises(tqstream.ConfigError, match="durability"):
        tqstream.ControllerConfig(durability="always", journal="/tmp/x")


def test_a_controller_without_a_journal_is_not_restarted() -> None:
    with ProcessCluster(1) as c, pytest.raises(tqstream.ConfigError, match="journal"):
        c.restart_controller()


def _in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_kill_in_the_middle_of_a_clear_leaves_it_done_and_the_bytes_freed(
    durable: ProcessCluster,
) -> None:
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"])
        for i in range(8):
            c.put(_rows(4 * i, 64), "p")
        assert sum(u.bytes for u in c.stats().units) > 0
        thread, out = _in_thread(lambda: c.clear_partition("p"))
        durable.procs[0].kill()  # before, during or after the clear: it happens once
        durable.procs[0].wait()
        durable.restart_controller()
        thread.join(30)
        assert out and not isinstance(out[0], BaseException), out
        assert "p" not in c.stats().partitions
        deadline = time.monotonic() + 10
        while sum(u.bytes for u in c.stats().units) and time.monotonic() < deadline:
            time.sleep(0.1)  # the drop orders replayed go out once the units are reconnected
        assert sum(u.bytes for u in c.stats().units) == 0


def test_a_kill_in_the_middle_of_a_checkpoint_save_still_saves_it(
    durable: ProcessCluster, tmp_path: Path
) -> None:
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        for i in range(8):
            c.put(_rows(4 * i), "p")
        path = tmp_path / "ckpt"
        thread, out = _in_thread(lambda: c.save_checkpoint(path))
        durable.procs[0].kill()
        durable.procs[0].wait()
        durable.restart_controller()
        thread.join(60)
        assert out and not isinstance(out[0], BaseException), out
    with ProcessCluster(1) as fresh, tqstream.connect(fresh.address) as c:
        assert c.load_checkpoint(path).rows == 32
        batch = c.get("p", "x", 32, "t", timeout=5)
        assert sorted(batch.data["x"][:, 0].tolist()) == [float(x) for x in range(32)]


def test_a_torn_last_record_is_cut_off_and_the_rest_replayed(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    cluster = ProcessCluster(1, durability="batched", journal=str(journal))
    with cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        for i in range(4):
            c.put(_rows(4 * i), "p")
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        segment = max(journal.glob("journal-*"))
        with open(segment, "ab") as f:  # the process died in the middle of a write
            f.write(b"\x17\x00\x00\x00torn")
        cluster.restart_controller()
        assert c.stats("p").partitions["p"].rows == 16
        c.put(_rows(16), "p")  # appending goes on after the cut
        batch = c.get("p", "x", 20, "t", timeout=5)
        assert sorted(batch.data["x"][:, 0].tolist()) == [float(x) for x in range(20)]


def test_admission_slots_granted_before_a_kill_are_still_held_after_it(
    durable: ProcessCluster,
) -> None:
    with tqstream.connect(durable.address, FAST) as c:
        slots = c.admission("slots", name="adm", max_pending_slots=2, max_version_slots=100)
        held = slots.acquire(2, timeout=5)
        parked, out = _in_thread(lambda: slots.acquire(1, timeout=30))  # waits for a slot
        time.sleep(0.3)
        _restart(durable)
        assert not out  # both slots are still held: the third still waits
        slots.release(held[:1])  # the restarted controller knows them
        parked.join(20)
        assert out and isinstance(out[0], list) and len(out[0]) == 1, out
        slots.release([*held[1:], *out[0]])  # type: ignore[misc]


def test_a_full_disk_degrades_the_journal_the_controller_serves_on_and_recovers(
    tmp_path: Path,
) -> None:
    """The journal's disk fills up: the controller keeps serving, warns with a typed warning and
    says so in its metrics; a snapshot retried makes the journal whole again."""
    import socket
    import urllib.request

    from tqstream.client.client import Client
    from tqstream.errors import DurabilityWarning
    from tqstream.launch.embedded import EmbeddedCluster

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = tqstream.ControllerConfig(
        durability="batched", journal=str(tmp_path / "journal"), metrics_port=port
    )
    cluster = EmbeddedCluster(config, tqstream.StorageConfig())
    client = Client(cluster.address, FAST, on_close=cluster.close)

    def degraded() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("tqstream_journal_degraded "):
                    return float(line.split()[1])
        raise AssertionError("no tqstream_journal_degraded in the metrics")

    with client:
        client.create_partition("p", ["x"], tasks=["t"])
        client.put(_rows(0), "p")
        assert degraded() == 0
        journal = cluster.controller.durable.journal  # type: ignore[union-attr]
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, journal._segment.fd)  # the disk is full from now on
        os.close(full)
        # the write fails (ENOSPC), or the batch's fsync comes first (/dev/full takes none)
        with pytest.warns(DurabilityWarning, match="No space left on device|fsync of the journal"):
            client.put(_rows(4), "p")  # answered all the same
            time.sleep(0.2)
        assert degraded() == 1
        batch = client.get("p", "x", 8, "t", timeout=5)  # serving goes on
        assert sorted(batch.data["x"][:, 0].tolist()) == [float(x) for x in range(8)]
        batch.ack()
        deadline = time.monotonic() + 15
        while degraded() and time.monotonic() < deadline:
            time.sleep(0.2)  # a snapshot is tried every few seconds; it lands in a new file
        assert degraded() == 0


def test_a_controller_that_does_not_come_back_fails_requests_naming_it(tmp_path: Path) -> None:
    cluster = ProcessCluster(1, durability="batched", journal=str(tmp_path / "journal"))
    config = tqstream.ClientConfig(connect_timeout=3.0, reconnect_timeout=2.0)
    with cluster, tqstream.connect(cluster.address, config) as c:
        c.create_partition("p", ["x"])
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        time.sleep(0.5)  # the connection has seen it go
        with pytest.raises(tqstream.ControllerUnavailableError, match="did not come back"):
            c.stats("p")


def test_a_controller_restarted_without_its_journal_fails_requests_in_flight_naming_it(
    tmp_path: Path,
) -> None:
    """The journal was lost (moved away, another disk): the controller at the old address is
    another cluster, which knows none of the requests in flight; they fail, saying so, rather
    than being sent again to a state that never saw the rows they name."""
    journal = tmp_path / "journal"
    cluster = ProcessCluster(1, durability="batched", journal=str(journal))
    with cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"])
        c.put(_rows(0), "p")
        welcomed, down = threading.Event(), threading.Event()

        def in_flight() -> object:
            c.stats("p")  # this thread's connection, welcomed by the first cluster
            welcomed.set()
            down.wait(10)
            return c.stats("p")  # sent while the controller is down

        thread, out = _in_thread(in_flight)
        assert welcomed.wait(10)
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        down.set()
        time.sleep(0.5)
        shutil.rmtree(journal)
        cluster.restart_controller()
        thread.join(30)
        # a thread's first call opens its connection: it reaches the new cluster, refused too
        fresh, first = _in_thread(lambda: c.stats("p"))
        fresh.join(30)
        for got in (out, first):
            assert got and isinstance(got[0], tqstream.ControllerUnavailableError), got
            assert "is another cluster now" in str(got[0])
            assert "without its journal" in str(got[0])


def test_a_get_sent_again_is_answered_as_the_first_time_and_leases_once(
    durable: ProcessCluster,
) -> None:
    """A get whose answer the client did not see is sent again with its rid (as a connection
    does after a drop): it gets the rows of its first answer, before and after a restart, and
    one batch is leased, not two."""
    with tqstream.connect(durable.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        for i in range(4):
            c.put(_rows(4 * i), "p")
        get = GetMeta(rid=7, partition="p", fields=["x"], batch_size=4, task="t", timeout=5.0)

        async def exchange() -> None:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)  # the session's one connection: it stays open
            sock.connect(durable.address)

            async def ask() -> list[int]:
                await sock.send(encode(get))
                reply = decode_reply((await sock.recv_multipart())[0])
                assert isinstance(reply, MetaReply) and reply.meta is not None, reply
                return list(reply.meta.row_ids)

            async def hello() -> None:
                await sock.send(encode(Hello(rid=1, protocol=PROTOCOL_VERSION, session=b"s" * 16)))
                assert isinstance(decode_reply(await sock.recv()), Welcome)

            try:
                await hello()
                first, again = await ask(), await ask()
                assert first == again and len(first) == 4
                assert c.stats("p").partitions["p"].tasks["t"].leased == 4
                _restart(durable)
                await hello()  # a new process: the connection says who it is again
                assert await ask() == first
                t = c.stats("p").partitions["p"].tasks["t"]
                assert (t.leased, t.available) == (4, 12)
            finally:
                sock.close(linger=0)
                ctx.destroy(linger=0)

        asyncio.run(exchange())


_HOLDER = """
import sys, time, torch, tqstream
c = tqstream.connect(sys.argv[1])
slots = c.admission("slots", name="adm", max_pending_slots=2, max_version_slots=100)
slots.acquire(2, timeout=10)
batch = c.get("p", "x", 8, "t", timeout=10)  # leased, never acked
print("READY", flush=True)
time.sleep(600)
"""


def test_a_client_that_dies_while_the_controller_is_down_gives_back_what_it_held(
    tmp_path: Path,
) -> None:
    """Its admission slots and leases come back once it has not reconnected within
    reconnect_grace, long before their own deadlines."""
    journal = str(tmp_path / "journal")
    cluster = ProcessCluster(1, durability="batched", journal=journal, reconnect_grace=2.0,
                             lease_timeout=300.0)  # fmt: skip
    with cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        c.put(_rows(0, 8), "p")
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, cluster.address],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline().strip() == "READY"
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        holder.kill()  # dies while nobody watches it
        holder.wait()
        cluster.restart_controller()
        slots = c.admission("slots", name="adm", max_pending_slots=2, max_version_slots=100)
        started = time.monotonic()
        assert len(slots.acquire(2, timeout=30)) == 2  # the dead client's, given back
        batch = c.get("p", "x", 8, "t", timeout=30)  # its lease ended with it
        assert time.monotonic() - started < 20  # not at the lease's deadline (300 s)
        assert sorted(batch.data["x"][:, 0].tolist()) == [float(x) for x in range(8)]
        batch.ack()


def test_a_clear_a_snapshot_took_while_its_bytes_were_freed_is_answered_after_a_kill(
    tmp_path: Path,
) -> None:
    """The controller dies after a snapshot took the clear, before the unit freed its bytes:
    nothing replays the clear; the client sent it again gets its answer, the bytes go."""
    journal = tmp_path / "journal"
    cluster = ProcessCluster(1, durability="sync", journal=str(journal), snapshot_records=1,
                             storage_timeout=60.0)  # fmt: skip
    with cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"])
        for i in range(4):
            c.put(_rows(4 * i, 64), "p")
        assert c.stats().units[0].rows == 256
        unit = cluster.procs[1]
        unit.send_signal(signal.SIGSTOP)  # the drop order waits on it
        try:
            snapshots = sorted(journal.glob("snapshot-*"))
            thread, out = _in_thread(lambda: c.clear_partition("p"))
            deadline = time.monotonic() + 10
            while sorted(journal.glob("snapshot-*")) == snapshots:  # the clear's snapshot
                assert time.monotonic() < deadline, "no snapshot after the clear"
                time.sleep(0.05)
            cluster.procs[0].kill()
            cluster.procs[0].wait()
        finally:
            unit.send_signal(signal.SIGCONT)
        cluster.restart_controller()
        thread.join(30)
        assert out and not isinstance(out[0], BaseException), out
        assert "p" not in c.stats().partitions
        deadline = time.monotonic() + 10
        while c.stats().units[0].rows and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats().units[0].rows == 0 and c.stats().units[0].bytes == 0


async def _stray_rows(address: str, partition: str, generation: int, first: int) -> None:
    """Store rows on a storage unit behind the controller's back (a chunk no put placed)."""
    _, columns = columns_from_data(_rows(first, 16))
    refs, buffers = columns_to_wire(columns)
    msg = Store(rid=0, partition=partition, chunk=(1 << 40) + first, row_ids=list(range(first,
                first + 16)), columns=refs, generation=generation)  # fmt: skip
    ctx = zmq.asyncio.Context()
    try:
        conn = await Connection.open(ctx, address, connect_timeout=5.0, heartbeat_interval=1.0,
                                     max_message_bytes=1 << 30)  # fmt: skip
        reply, _ = await conn.request(msg, buffers, timeout=5)
        assert isinstance(reply, Ok)
        conn.close()
    finally:
        ctx.destroy(linger=0)


def test_rows_a_unit_holds_that_no_row_names_are_freed_after_a_restart(tmp_path: Path) -> None:
    """A restarted controller asks each unit which rows it holds and frees those no row of its
    journal names: of a partition it knows, and of one it never knew."""
    cluster = ProcessCluster(1, durability="batched", journal=str(tmp_path / "journal"))
    with cluster, tqstream.connect(cluster.address, FAST) as c:
        c.create_partition("p", ["x"], tasks=["t"])
        meta = c.put(_rows(0, 8), "p")
        unit = c.stats().units[0].address
        asyncio.run(_stray_rows(unit, "p", meta.generation, 1000))
        asyncio.run(_stray_rows(unit, "ghost", 1, 0))
        assert c.stats().units[0].rows == 8 + 16 + 16
        _restart(cluster)
        assert c.stats().units[0].rows == 8
        batch = c.get("p", "x", 8, "t", timeout=5)  # the rows it knows are untouched
        assert torch.equal(batch.data["x"], _rows(0, 8)["x"])
