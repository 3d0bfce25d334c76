"""The controller's write-ahead journal (``controller/journal.py``, ``controller/journalfile.py``):
records come back in order, a turn's records are one write, a reply's future resolves only once
its batch is durable (``sync``: after an fsync covering it), a torn tail is cut off wherever the
write stopped, damage before the end and journals of another cluster or format are refused by
name, a full disk degrades the journal without failing anyone and a snapshot makes it whole
again. Real processes: a writer killed at random loses nothing it acknowledged; a writer whose
files may not grow (``RLIMIT_FSIZE``) keeps serving and recovers."""

from __future__ import annotations

import asyncio
import errno
import gc
import itertools
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_child import CLUSTER, payload, seq_kind, snapshot

from tqstream.controller import journalfile
from tqstream.controller.journal import Journal, JournalConfig
from tqstream.errors import (
    ConfigError,
    DurabilityWarning,
    JournalClusterError,
    JournalCorruptError,
    JournalError,
    JournalVersionError,
)

CHILD = Path(__file__).with_name("journal_child.py")


def opened(path: Path, durability: str = "batched", **kw: Any) -> tuple[Journal, Any]:
    return Journal.open(str(path), "c1", JournalConfig(durability, **kw))  # type: ignore[arg-type]


def replayed(path: Path, cluster: str = "c1") -> tuple[Any, list[tuple[int, bytes]]]:
    journal, replay = Journal.open(str(path), cluster)
    records = [(kind, bytes(p)) for kind, p in replay]
    journal.close()
    return replay, records


def segments(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".tqj"))


def write(path: Path, records: list[tuple[int, bytes]], durability: str = "batched") -> None:
    """Append ``records``, one turn each, and close."""

    async def run() -> None:
        journal, _ = opened(path, durability)
        for kind, data in records:
            journal.append(kind, data)
            wait = journal.durable()
            assert wait is not None and await wait
        journal.close()

    asyncio.run(run())


RECORDS = [(i % 5, os.urandom(i * 37 % 300)) for i in range(40)]


def test_records_come_back_in_order_and_numbering_continues(tmp_path: Path) -> None:
    write(tmp_path, RECORDS[:25])
    write(tmp_path, RECORDS[25:])  # a reopened journal appends after what it replayed
    replay, records = replayed(tmp_path)
    assert records == RECORDS
    assert (replay.base, replay.last, len(replay), replay.dropped_bytes) == (0, 40, 40, 0)
    assert replay.snapshot is None
    assert segments(tmp_path) == ["journal-00000000000000000001.tqj"]


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="'off' is a controller without a journal"):
        JournalConfig("off")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fsync_interval"):
        JournalConfig(fsync_interval=-1)


def test_a_turn_of_appends_is_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []
    real = os.write

    def counting(fd: int, data: Any) -> int:
        writes.append(len(data))
        return real(fd, data)

    async def run() -> None:
        journal, _ = opened(tmp_path)
        monkeypatch.setattr(os, "write", counting)
        for i in range(200):  # many handlers in one turn
            journal.append(1, payload(i))
        futures = {id(journal.durable(seq)) for seq in range(1, 201)}
        assert len(futures) == 1  # every reply of the turn waits for the same batch
        wait = journal.durable()
        assert writes == [] and wait is not None
        assert await wait
        assert len(writes) == 1 and journal.durable() is None
        journal.append(1, b"next turn")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(writes) == 2
        assert journal.stats().writes == 2 and journal.stats().records == 201
        journal.close()

    asyncio.run(run())


def test_sync_resolves_only_after_an_fsync_that_covers_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    covered: list[int] = []  # file sizes that completed fsyncs covered
    real = os.fsync

    def slow_fsync(fd: int) -> None:
        size = os.fstat(fd).st_size
        time.sleep(0.02)
        real(fd)
        covered.append(size)

    async def run() -> None:
        journal, _ = opened(tmp_path, "sync")
        monkeypatch.setattr(os, "fsync", slow_fsync)
        for turn in range(5):
            for i in range(10):
                journal.append(turn, payload(i))
            wait = journal.durable()
            assert wait is not None
            await asyncio.sleep(0)
            await asyncio.sleep(0)  # written now, not yet fsynced
            segment = journal._segment
            assert segment is not None
            assert not wait.done()
            end = segment.size
            assert await wait
            assert max(covered) >= end  # an fsync that returned covered the batch
        # batches written while an fsync runs share the next one
        tickets = []
        for _ in range(20):
            journal.append(9, b"x" * 100)
            tickets.append(journal.durable())
            await asyncio.sleep(0.002)
        before = journal.stats().fsyncs
        assert all(await asyncio.gather(*[t for t in tickets if t is not None]))
        assert journal.stats().fsyncs - before < 20
        journal.close()

    asyncio.run(run())


def test_batched_resolves_at_the_write_and_fsyncs_at_most_every_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs: list[float] = []
    real = os.fsync

    def timed(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # the segment's, not its directory's
            fsyncs.append(time.monotonic())
        real(fd)

    async def run() -> None:
        journal, _ = opened(tmp_path, "batched", fsync_interval=0.05)
        monkeypatch.setattr(os, "fsync", timed)
        start = time.monotonic()
        while time.monotonic() - start < 0.3:
            journal.append(1, b"y" * 200)
            wait = journal.durable()
            assert wait is not None and await wait  # the write, not an fsync
        gaps = [b - a for a, b in itertools.pairwise(fsyncs)]
        assert len(fsyncs) <= 8 and all(g >= 0.045 for g in gaps), gaps
        journal.close()

    asyncio.run(run())
    assert fsyncs  # close fsyncs what is left


def test_a_process_killed_at_random_loses_nothing_it_acknowledged(tmp_path: Path) -> None:
    rng = random.Random(1)
    for durability in ("batched", "sync"):
        for rebase_every in (0, 300):
            directory = tmp_path / f"{durability}-{rebase_every}"
            for _ in range(3):  # each kill continues the same journal
                acked = kill_at_random(directory, durability, rebase_every, rng)
                check_whole(directory, acked)


def kill_at_random(directory: Path, durability: str, rebase_every: int, rng: random.Random) -> int:
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), "appends", durability, str(rebase_every)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "READY"
        acked, goal = 0, rng.randint(20, 400)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(child.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 30
        while sum(1 for line in lines if line.startswith("ACK")) < goal:
            assert time.monotonic() < deadline and child.poll() is None, lines[-3:]
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait()
        reader.join(5)
        acked = max(int(line.split()[1]) for line in lines if line.startswith("ACK"))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return acked


def check_whole(directory: Path, acked: int) -> None:
    journal, replay = Journal.open(str(directory), CLUSTER)
    try:
        if replay.snapshot is not None:
            assert bytes(replay.snapshot) == snapshot(replay.base)
        seq = replay.base
        for kind, data in replay:
            seq += 1
            assert (kind, bytes(data)) == (seq_kind(seq), payload(seq)), seq
        assert seq == replay.last >= acked
    finally:
        journal.close()


def last_record_span(path: Path) -> tuple[Path, int, int]:
    """(segment, offset of the last record, file size)."""
    segment = path / segments(path)[-1]
    data = segment.read_bytes()
    offset, last = journalfile._read_prelude(data, str(segment), b"TQSJRNL\n", "c1", False)[1], 0
    while offset < len(data):
        last = offset
        offset += journalfile._FRAME.size + journalfile._FRAME.unpack_from(data, offset)[0]
    return segment, last, len(data)


def test_a_torn_last_record_is_cut_off_wherever_the_write_stopped(tmp_path: Path) -> None:
    source = tmp_path / "source"
    write(source, RECORDS[:10])
    segment, start, size = last_record_span(source)
    original = segment.read_bytes()
    for cut in range(start, size):
        trial = tmp_path / f"cut-{cut}"
        shutil.copytree(source, trial)
        (trial / segment.name).write_bytes(original[:cut])
        replay, records = replayed(trial)
        assert records == RECORDS[:9] and replay.dropped_bytes == cut - start, cut
        assert (trial / segment.name).stat().st_size == start  # cut off on disk too
        if cut % 50 == 0:  # and appending goes on from there
            write(trial, RECORDS[20:22])
            assert replayed(trial)[1] == RECORDS[:9] + RECORDS[20:22]
        shutil.rmtree(trial)


def test_a_tail_of_zeros_and_a_torn_segment_header_are_torn_tails(tmp_path: Path) -> None:
    write(tmp_path, RECORDS[:5])
    segment = tmp_path / segments(tmp_path)[-1]
    with open(segment, "ab") as f:
        f.write(bytes(4096))  # a crash left the file longer than what reached it
    replay, records = replayed(tmp_path)
    assert records == RECORDS[:5] and replay.dropped_bytes == 4096
    empty = tmp_path / "empty"
    write(empty, [])
    segment = empty / segments(empty)[0]
    segment.write_bytes(segment.read_bytes()[:10])  # the crash came while it was being started
    replay, records = replayed(empty)
    assert records == [] and replay.dropped_bytes == 10


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["payload", "length", "crc"])
def test_damage_before_the_end_is_refused_by_name(tmp_path: Path, where: str) -> None:
    write(tmp_path, RECORDS[:10])
    segment = tmp_path / segments(tmp_path)[0]
    data = segment.read_bytes()
    offset = journalfile._read_prelude(data, str(segment), b"TQSJRNL\n", "c1", False)[1]
    for _ in range(4):  # to record 5
        offset += journalfile._FRAME.size + journalfile._FRAME.unpack_from(data, offset)[0]
    flip(segment, offset + {"payload": 13, "length": 1, "crc": 9}[where])
    with pytest.raises(JournalCorruptError, match=rf"damaged at byte {offset} \(record 5\)") as e:
        Journal.open(str(tmp_path), "c1")
    assert str(segment) in str(e.value) and "not one" in str(e.value)
    assert e.value.details["seq"] == 5
    Journal.open(str(tmp_path / "other"), "c1")[0].close()  # the lock was given back


def test_a_damaged_last_record_is_a_torn_tail(tmp_path: Path) -> None:
    write(tmp_path, RECORDS[:10])
    segment, start, size = last_record_span(tmp_path)
    flip(segment, size - 1)
    replay, records = replayed(tmp_path)
    assert records == RECORDS[:9] and replay.dropped_bytes == size - start


def test_another_cluster_or_format_is_refused_naming_both(tmp_path: Path) -> None:
    write(tmp_path, RECORDS[:3])
    with pytest.raises(JournalClusterError, match=r"belongs to cluster 'c1'.*cluster 'c2'") as e:
        Journal.open(str(tmp_path), "c2")
    assert e.value.details["journal_cluster"] == "c1"
    segment = tmp_path / segments(tmp_path)[0]
    data = bytearray(segment.read_bytes())
    data[8:10] = (2).to_bytes(2, "little")
    segment.write_bytes(bytes(data))
    with pytest.raises(JournalVersionError, match="journal format 2; this tqstream reads format 1"):
        Journal.open(str(tmp_path), "c1")
    segment.write_bytes(b"not a journal at all, just bytes")
    with pytest.raises(JournalCorruptError, match="is not a tqstream journal segment"):
        Journal.open(str(tmp_path), "c1")


def test_a_snapshot_of_another_cluster_or_format_is_refused_naming_both(tmp_path: Path) -> None:
    journalfile.write_snapshot(str(tmp_path), "c1", 4, b"state after 4")
    (path,) = tmp_path.glob("snapshot-*.tqs")
    with pytest.raises(JournalClusterError, match=r"'c1'.*'c2'"):
        Journal.open(str(tmp_path), "c2")
    data = bytearray(path.read_bytes())
    data[8:10] = (2).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(JournalVersionError, match=r"snapshot .* is in journal format 2") as e:
        Journal.open(str(tmp_path), "c1")
    assert (e.value.details["format"], e.value.details["expected"]) == (2, journalfile.FORMAT)
    path.write_bytes(b"TQSJRNL\n" + bytes(data[8:]))  # a segment's magic in a snapshot's name
    with pytest.raises(JournalCorruptError, match="is not a tqstream journal snapshot"):
        Journal.open(str(tmp_path), "c1")


def test_one_controller_per_journal(tmp_path: Path) -> None:
    journal, _ = opened(tmp_path)
    with pytest.raises(JournalError, match="open in another controller"):
        opened(tmp_path)
    journal.close()
    journal.close()  # idempotent
    opened(tmp_path)[0].close()


def test_a_snapshot_rebases_the_journal(tmp_path: Path) -> None:
    async def run() -> None:
        journal, _ = opened(tmp_path, "sync")
        for i in range(10):
            journal.append(1, payload(i))
        task = journal.rebase(b"state after 10")
        with pytest.raises(JournalError, match="under way"):
            journal.rebase(b"again")
        for i in range(10, 15):  # appended while the snapshot is written
            journal.append(1, payload(i))
        assert await task and not journal.rebasing
        wait = journal.durable()
        assert wait is None or await wait
        assert journal.stats().base == 10 and journal.stats().rebases == 1
        journal.close()

    asyncio.run(run())
    replay, records = replayed(tmp_path)
    assert bytes(replay.snapshot) == b"state after 10" and replay.base == 10
    assert records == [(1, payload(i)) for i in range(10, 15)]
    assert sorted(os.listdir(tmp_path)) == [
        "LOCK",
        "journal-00000000000000000011.tqj",
        "snapshot-00000000000000000010.tqs",
    ]

    async def again() -> None:
        journal, _ = opened(tmp_path)
        journal.append(1, b"16")
        assert await journal.rebase(b"state after 16")
        journal.close()

    asyncio.run(again())
    replay, records = replayed(tmp_path)
    assert (bytes(replay.snapshot), replay.base, records) == (b"state after 16", 16, [])
    assert sorted(os.listdir(tmp_path))[1:] == [
        "journal-00000000000000000017.tqj",
        "snapshot-00000000000000000016.tqs",
    ]


def test_a_snapshot_that_cannot_be_written_leaves_the_chain_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def run() -> None:
        journal, _ = opened(tmp_path)
        for i in range(5):
            journal.append(1, payload(i))
        monkeypatch.setattr(journalfile, "write_snapshot", full)
        assert not await journal.rebase(b"never lands")
        assert journal.degraded is None and journal.stats().rebase_failures == 1
        for i in range(5, 8):
            journal.append(1, payload(i))
        journal.close()

    asyncio.run(run())
    assert len(segments(tmp_path)) == 2
    (tmp_path / "snapshot-00000000000000000005.tqs.tmp").write_bytes(b"half")
    replay, records = replayed(tmp_path)
    assert replay.snapshot is None and records == [(1, payload(i)) for i in range(8)]
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
    os.unlink(tmp_path / segments(tmp_path)[0])  # records 1..5 gone: the chain has a gap
    with pytest.raises(JournalCorruptError, match="lacks records: after record 0 comes"):
        Journal.open(str(tmp_path), "c1")


def test_a_full_disk_degrades_the_journal_and_a_rebase_restores_it(tmp_path: Path) -> None:
    events: list[str] = []

    async def run() -> None:
        journal, _ = opened(tmp_path, "batched", fsync_interval=30.0)
        journal.on_degraded = lambda reason: events.append(f"degraded: {reason}")
        journal.on_restored = lambda: events.append("restored")
        for i in range(3):
            journal.append(1, payload(i))
        wait = journal.durable()
        assert wait is not None and await wait
        while journal.stats().fsyncs < 1:  # the first fsync is done: the next is 30 s away
            await asyncio.sleep(0.001)
        segment = journal._segment
        assert segment is not None
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, segment.fd)  # the disk is full from now on
        os.close(full)
        journal.append(1, payload(3))
        wait = journal.durable()
        assert wait is not None
        with pytest.warns(DurabilityWarning, match="No space left on device") as warned:
            assert await wait is False
        assert warned[0].message.details["directory"] == str(tmp_path)  # type: ignore[union-attr]
        assert "No space left on device" in (journal.degraded or "")
        for i in range(4, 10):  # serving goes on, nothing waits
            assert journal.append(1, payload(i)) == i + 1
            assert journal.durable() is None
        assert journal.stats().lost == 7
        task = journal.rebase(snapshot(10))
        for i in range(10, 12):  # held while the snapshot is written, then written after it
            journal.append(1, payload(i))
        assert await task
        assert journal.degraded is None
        journal.append(1, payload(12))
        wait = journal.durable()
        assert wait is not None and await wait
        journal.close()

    asyncio.run(run())
    assert events[0].startswith("degraded: writing records 4..4") and events[1:] == ["restored"]
    replay, records = replayed(tmp_path)
    assert bytes(replay.snapshot) == snapshot(10) and replay.base == 10
    assert records == [(1, payload(i)) for i in range(10, 13)]


def test_a_failed_fsync_degrades_a_sync_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async def run() -> None:
        journal, _ = opened(tmp_path, "sync")
        monkeypatch.setattr(os, "fsync", broken)
        journal.append(1, b"never acknowledged")
        wait = journal.durable()
        assert wait is not None
        with pytest.warns(DurabilityWarning, match="fsync of the journal failed"):
            assert await wait is False
        assert journal.durable() is None and journal.stats().degraded
        monkeypatch.undo()
        assert await journal.rebase(b"whole again")
        assert journal.degraded is None
        journal.close()

    asyncio.run(run())
    replay, records = replayed(tmp_path)
    assert (bytes(replay.snapshot), replay.base, records) == (b"whole again", 1, [])


def test_a_journal_nobody_closed_is_closed_when_collected(tmp_path: Path) -> None:
    async def run() -> None:
        journal, _ = opened(tmp_path)
        journal.append(1, b"kept")
        await asyncio.sleep(0)

    asyncio.run(run())
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name == "tqstream-journal-sync"]
    assert replayed(tmp_path)[1] == [(1, b"kept")]  # the lock is free, the record written


def test_a_process_whose_files_may_not_grow_keeps_serving_and_recovers(tmp_path: Path) -> None:
    limit = 64 * 1024
    out = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), "full", str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["last_durable_result"] is False
    assert "File too large" in report["reason"]
    assert len(report["warnings"]) == 1 and "keeps serving" in report["warnings"][0]
    assert report["too_large_rebase"] is False
    assert "writing a snapshot failed too" in report["degraded_after_failed_rebase"]
    assert report["rebase"] is True and report["degraded_after_rebase"] is None
    assert report["durable_after"] is True
    assert report["stats"]["lost"] >= 51
    journal, replay = Journal.open(str(tmp_path), CLUSTER)
    assert bytes(replay.snapshot) == snapshot(report["base"]) and replay.base == report["base"]
    assert [(k, bytes(p)) for k, p in replay] == [(2, payload(i)) for i in range(25)]
    journal.close()


# --- the framing, as a property ---
def build(directory: str, records: list[tuple[int, bytes]]) -> tuple[str, list[int]]:
    """A segment holding ``records``; its path and where each record ends."""
    segment = journalfile.create_segment(directory, "c1", 1)
    buf = bytearray()
    ends = []
    for kind, data in records:
        journalfile.frame_into(buf, kind, data)
        ends.append(segment.size + len(buf))
    journalfile.write_all(segment.fd, buf)
    os.close(segment.fd)
    return segment.path, ends


records_strategy = st.lists(
    st.tuples(st.integers(0, 65535), st.binary(max_size=200)), min_size=1, max_size=20
)


@settings(max_examples=150, deadline=None)
@given(records=records_strategy, cut=st.floats(0, 1))
def test_any_cut_replays_exactly_the_whole_records_before_it(
    records: list[tuple[int, bytes]], cut: float
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path, ends = build(directory, records)
        at = int(ends[-1] * cut)
        os.truncate(path, at)
        whole = [i for i, end in enumerate(ends) if end <= at]
        replay, _ = journalfile.recover(directory, "c1")
        assert [(k, bytes(p)) for k, p in replay] == records[: len(whole)]
        prelude = ends[0] - 12 - len(records[0][1])
        kept = ends[whole[-1]] if whole else prelude
        # a cut inside the segment's prelude drops the file: a crash while it was being started
        assert replay.dropped_bytes == (at if at < prelude else at - kept)


@settings(max_examples=150, deadline=None)
@given(records=records_strategy, where=st.floats(0, 1), bit=st.integers(0, 7))
def test_a_flipped_bit_is_never_replayed(
    records: list[tuple[int, bytes]], where: float, bit: int
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path, ends = build(directory, records)
        data = bytearray(Path(path).read_bytes())
        start = ends[0] - 12 - len(records[0][1])
        at = start + int((len(data) - start - 1) * where)
        data[at] ^= 1 << bit
        Path(path).write_bytes(bytes(data))
        try:
            replay, _ = journalfile.recover(directory, "c1")
        except JournalCorruptError:
            return
        back = [(k, bytes(p)) for k, p in replay]
        assert back == records[: len(back)]  # a prefix: the damaged record was the last
        assert len(back) == len(records) - 1


def test_a_snapshot_is_due_after_its_records_or_their_replay_time(tmp_path: Path) -> None:
    """A restart replays what the requests since the last snapshot cost to handle: a snapshot is
    due after ``snapshot_records`` records, or once their handling took ``REPLAY_SECONDS`` — but
    not more often than ten times the time a snapshot holds the loop."""
    from tqstream.controller.durable import REPLAY_SECONDS, Durable

    async def run() -> None:
        d = Durable(str(tmp_path), "batched", 0.005, snapshot_records=3)
        for _ in range(2):
            d.event(1, "x")
        assert not d.due()
        d.event(1, "x")
        assert d.due()  # the third record
        assert await d.snapshot({"state": None})
        assert not d.due() and d.pause > 0.0
        d.event(1, "x")
        d.worked(REPLAY_SECONDS / 2)
        assert not d.due()
        d.worked(REPLAY_SECONDS / 2)
        assert d.due()  # handled for REPLAY_SECONDS: a replay would take as long
        assert await d.snapshot({"state": None})
        d.pause = REPLAY_SECONDS / 4  # a large state: a snapshot costs a quarter of the budget
        d.worked(REPLAY_SECONDS)
        assert not d.due()
        d.worked(1.5 * REPLAY_SECONDS)
        assert d.due()  # ten pauses' worth
        d.journal.close()

    asyncio.run(run())
