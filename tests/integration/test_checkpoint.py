"""Checkpoint and resume of the buffer, with real clusters: a cluster is saved, killed (SIGKILL
for processes) and a fresh one restored from the files serves every task exactly the rows it had
not acked, with the data that was put."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LEASE_TIMEOUT, PUT_TIMEOUT

import tqstream
from tqstream.convert.inputs import columns_from_data
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol.connection import Connection
from tqstream.protocol.messages import Ok, PreparePut, PutPlan, Store
from tqstream.protocol.wire import column_to_wire

FIELDS = ["tokens", "logp", "reward", "mask", "prompt", "info"]
BIG = 300_000  # float32 per row of the big put: 1.2 MB a row, through shared memory


class Cluster:
    """A deployment of its own for one test: killable processes, or an embedded one."""

    def __init__(self, kind: str, units: int) -> None:
        self.kind = kind
        self.procs: ProcessCluster | None = None
        if kind == "processes":
            self.procs = ProcessCluster(units, lease_timeout=LEASE_TIMEOUT, put_timeout=PUT_TIMEOUT)
            self.client = tqstream.connect(self.procs.address)
        else:
            self.client = tqstream.init(
                storage_units=units, lease_timeout=LEASE_TIMEOUT, put_timeout=PUT_TIMEOUT
            )

    def crash(self) -> None:
        """SIGKILL every process (the embedded cluster just stops): nothing is flushed."""
        if self.procs is not None:
            for p in self.procs.procs:
                p.kill()
            self.procs.close()
        self.client.close()


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    started: list[Cluster] = []
    yield started
    for c in started:
        c.crash()


def start(clusters: list[Cluster], kind: str, units: int) -> tqstream.Client:
    clusters.append(Cluster(kind, units))
    return clusters[-1].client


def row(i: int, big: bool = False) -> dict[str, Any]:
    """The content of rollout ``i``: ragged tokens and logprobs, a reward, a mask, a prompt and a
    JSON value (the big ones' logprobs go through shared memory)."""
    n = BIG if big else 3 + i % 5
    return {
        "tokens": torch.arange(n, dtype=torch.int64) + i,
        "logp": torch.linspace(-1.0, 0.0, n) * (i + 1),
        "reward": torch.tensor(float(i)),
        "mask": torch.tensor([i % 2 == 0, True, False]),
        "prompt": f"prompt {i} ✓",
        "info": {"i": i, "tags": ["a", i]},
    }


def batch(ids: list[int], big: bool = False) -> dict[str, Any]:
    rows = [row(i, big) for i in ids]
    return {
        "tokens": [r["tokens"] for r in rows],
        "logp": [r["logp"] for r in rows],
        "reward": torch.stack([r["reward"] for r in rows]),
        "mask": torch.stack([r["mask"] for r in rows]),
        "prompt": [r["prompt"] for r in rows],
        "info": [r["info"] for r in rows],
    }


def check_rows(got: tqstream.Batch, ids_of: dict[str, int], big: set[int]) -> None:
    """Every row of ``got`` holds what was put under its key."""
    td = got.data
    prompts, infos = td.get("prompt").tolist(), td.get("info").tolist()
    for j, key in enumerate(got.meta.keys):
        i = ids_of[key]
        want = row(i, i in big)
        assert torch.equal(td["tokens"][j], want["tokens"]), key
        assert torch.equal(td["logp"][j], want["logp"]), key
        assert torch.equal(td["reward"][j], want["reward"]), key
        assert torch.equal(td["mask"][j], want["mask"]), key
        assert (prompts[j], infos[j]) == (want["prompt"], want["info"]), key


@pytest.mark.parametrize(
    ("kind", "saved_on", "loaded_on"),
    [("embedded", 2, 2), ("embedded", 2, 1), ("processes", 2, 2), ("processes", 2, 3)],
)
def test_a_restored_cluster_serves_exactly_the_unacked_rows(
    clusters: list[Cluster], tmp_path: Path, kind: str, saved_on: int, loaded_on: int
) -> None:
    c = start(clusters, kind, saved_on)
    groups = [f"g{i // 2}" for i in range(8)]
    small = c.put(batch(list(range(8))), "train", keys=[f"r{i}" for i in range(8)],
                  groups=groups, version=1)  # fmt: skip
    large = c.put(batch([8, 9, 10, 11], big=True), "train", version=2)
    c.put_fields(small, {"adv": torch.arange(8, dtype=torch.float32) / 8})
    ids_of = dict(zip(small.keys + large.keys, range(12), strict=True))
    a = c.get("train", ["tokens", "reward"], 6, "A")
    a.ack()
    c.get("train", ["tokens"], 4, "B")  # leased at the save, never acked
    before = c.stats("train").partitions["train"]

    summary = c.save_checkpoint(tmp_path / "ckpt", metadata={"global_steps": 3})
    assert (summary.partitions, summary.rows, summary.units) == (1, 12, saved_on)
    assert summary.nbytes >= 4 * BIG * 12 and summary.metadata == {"global_steps": 3}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left
    clusters[-1].crash()

    c = start(clusters, kind, loaded_on)
    loaded = c.load_checkpoint(tmp_path / "ckpt")
    assert (loaded.rows, loaded.nbytes, loaded.metadata) == (
        12,
        summary.nbytes,
        {"global_steps": 3},
    )
    st = c.stats("train").partitions["train"]
    assert (st.rows, st.fields, st.schemas, st.produced) == (
        before.rows, before.fields, before.schemas, before.produced,
    )  # fmt: skip
    assert (st.tasks["A"].acked, st.tasks["A"].leased, st.tasks["A"].available) == (6, 0, 6)
    assert (st.tasks["B"].acked, st.tasks["B"].leased, st.tasks["B"].available) == (0, 0, 12)
    assert st.pending_puts == 0
    assert sum(u.bytes for u in c.stats().units) >= summary.nbytes
    if loaded_on > 1:
        assert sum(1 for u in c.stats().units if u.rows) > 1  # spread over the units

    big = {8, 9, 10, 11}
    got = c.get("train", FIELDS, 6, "A", timeout=10)  # A: exactly the six it had not acked
    assert set(got.meta.keys) == set(ids_of) - set(a.meta.keys)
    check_rows(got, ids_of, big)
    by_key = dict(zip(got.meta.keys, got.meta.version_start, strict=True))
    assert {k: v for k, v in by_key.items()} == {k: 1 if ids_of[k] < 8 else 2 for k in by_key}
    with pytest.raises(tqstream.RequestTimeoutError):
        c.get_meta("train", "tokens", 1, "A", timeout=0)
    got.ack()
    got = c.get("train", FIELDS, 12, "B", timeout=10)  # B's lease is gone: all twelve
    assert sorted(got.meta.keys) == sorted(ids_of)
    check_rows(got, ids_of, big)
    got.ack()
    got = c.get("train", ["tokens", "adv"], 8, "C", whole_groups=True, timeout=10)
    assert got.meta.groups == groups or sorted(got.meta.groups) == sorted(groups)
    assert torch.equal(got.data["adv"], torch.tensor([ids_of[k] / 8 for k in got.meta.keys]))

    # ids go on past the checkpoint's
    new = c.put(batch([12]), "train")
    assert new.keys[0] not in ids_of and new.row_ids[0] > max(small.row_ids + large.row_ids)
    with pytest.raises(tqstream.DuplicateKeyError):
        c.put(batch([13]), "train", keys=["r0"])
    assert c.clear_partition("train")
    assert c.stats().storage_bytes == 0


def test_registered_tasks_admissions_ttl_and_closes_come_back(
    clusters: list[Cluster], tmp_path: Path
) -> None:
    c = start(clusters, "embedded", 1)
    c.create_partition("q", ["tokens"], tasks=["A", "B"], producers=2)
    slots = c.admission("slots", name="adm", max_pending_slots=4, max_version_slots=10)
    ids = slots.acquire(3)
    slots.release(ids[:1], "accepted")
    meta = c.put(batch([0, 1, 2]), "q")
    c.get("q", "tokens", 3, "A").ack()
    c.close_partition("q")
    c.create_partition("t", ttl=30.0)
    c.put(batch([3]), "t")
    c.save_checkpoint(tmp_path / "ck")
    admissions = c.stats().admissions
    clusters[-1].crash()

    c = start(clusters, "embedded", 1)
    c.load_checkpoint(str(tmp_path / "ck"))
    st = c.stats()
    assert st.admissions == admissions and st.admissions["adm"]["running"] == 2
    assert st.partitions["q"].producers_open == 1 and st.partitions["t"].rows == 1
    slots = c.admission("slots", name="adm", max_pending_slots=4, max_version_slots=10)
    slots.release(ids[1:], "accepted")  # slots granted before the save are still the producers'
    got = c.get("q", "tokens", 3, "B")
    assert got.meta.keys == meta.keys
    got.ack()  # every registered task acked: the rows are freed
    assert c.stats("q").partitions["q"].rows == 0
    c.close_partition("q")
    with pytest.raises(tqstream.PartitionClosedError):
        c.put(batch([4]), "q")
    assert c.clear_partition("t") and c.stats().storage_bytes == 0


async def _store_without_commit(address: str, units: list[str], meanwhile: Any) -> Any:
    """A producer that stored a put's chunks and has not committed it while ``meanwhile()`` runs
    (on a thread); the put is rolled back when its connection closes."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    kw: dict[str, Any] = dict(
        connect_timeout=5.0, heartbeat_interval=1.0, max_message_bytes=1 << 30
    )
    ctrl = await Connection.open(ctx, address, **kw)
    n, cols = columns_from_data({"tokens": torch.zeros(4, 10, dtype=torch.int64)})
    req = PreparePut(rid=0, partition="train", n_rows=n, schemas={"tokens": cols["tokens"].schema},
                     nbytes=320, keys=[f"lost{i}" for i in range(4)])  # fmt: skip
    plan, _ = await ctrl.request(req, timeout=5)
    assert isinstance(plan, PutPlan)
    for seg in plan.segments:
        unit = await Connection.open(ctx, units[seg.unit], **kw)
        ref, bufs = column_to_wire("tokens", cols["tokens"].slice(seg.start, seg.stop), 1)
        rows = list(plan.rows()[seg.start : seg.stop])
        store = Store(rid=0, partition="train", chunk=seg.chunk, row_ids=rows, columns=[ref],
                      generation=plan.generation)  # fmt: skip
        reply, _ = await unit.request(store, bufs, timeout=5)
        assert isinstance(reply, Ok)
        unit.close()
    try:
        return await asyncio.to_thread(meanwhile)
    finally:
        ctrl.close()
        ctx.destroy(linger=0)


def test_a_put_in_flight_is_not_in_the_checkpoint(clusters: list[Cluster], tmp_path: Path) -> None:
    c = start(clusters, "processes", 2)
    c.put({"tokens": torch.ones(2, 10, dtype=torch.int64)}, "train", keys=["a", "b"])
    units = [u.address for u in c.stats().units]

    def save() -> tqstream.CheckpointSummary:
        assert c.stats("train").partitions["train"].pending_puts == 1
        return c.save_checkpoint(tmp_path / "ck")

    summary = asyncio.run(_store_without_commit(c.address, units, save))
    assert summary.rows == 2
    clusters[-1].crash()
    c = start(clusters, "processes", 2)
    c.load_checkpoint(tmp_path / "ck")
    assert sorted(c.list_keys("train")) == ["a", "b"]
    assert c.stats().storage_bytes == 2 * 10 * 8
    lost = [f"lost{i}" for i in range(4)]
    c.put({"tokens": torch.zeros(4, 10, dtype=torch.int64)}, "train", keys=lost)  # put again


def test_saving_while_producers_and_consumers_run(clusters: list[Cluster], tmp_path: Path) -> None:
    """Direct puts (their columns land at the unit after the commit) and acks that free rows go
    on during the save: what is restored is consistent and intact."""
    c = start(clusters, "processes", 2)
    c.create_partition("s", ["v"], tasks=["A"])
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        i = 0
        try:
            while not stop.is_set():
                c.put({"v": torch.full((1, 64), i), "k": [f"k{i}"]}, "s", keys=[f"k{i}"])
                i += 1
        except BaseException as exc:
            errors.append(exc)

    def consume() -> None:
        try:
            while not stop.is_set():
                c.get("s", ["v"], 4, "A", timeout=5).ack()
                stop.wait(0.02)  # slower than the producer: rows are held at every save
        except tqstream.RequestTimeoutError:
            pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=f, name=f"test-{f.__name__}") for f in (produce, consume)]
    for t in threads:
        t.start()
    try:
        waited = time.monotonic() + 30  # the producer's first put commits (its connections)
        while not c.stats("s").partitions["s"].produced and time.monotonic() < waited:
            time.sleep(0.01)
        summaries = [c.save_checkpoint(tmp_path / f"ck{n}") for n in range(3)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert any(s.rows for s in summaries)
    clusters[-1].crash()
    for n, summary in enumerate(summaries):
        c = start(clusters, "embedded", 1)
        c.load_checkpoint(tmp_path / f"ck{n}")
        st = c.stats("s").partitions["s"]
        task = st.tasks.get("A")  # none before the consumer's first get
        assert st.rows == summary.rows and (task is None or task.available == st.rows)
        if st.rows:
            got = c.get("s", ["v", "k"], st.rows, "A", timeout=5)
            for key, v, k in zip(got.meta.keys, got.data["v"], got.data.get("k").tolist(),
                                 strict=True):  # fmt: skip
                assert k == key and torch.equal(v, torch.full((64,), int(key[1:])))
            got.ack()
        assert c.stats().storage_bytes == 0
        clusters[-1].crash()


# --- refusals and failures ---
def test_refused_paths_and_clusters(clusters: list[Cluster], tmp_path: Path) -> None:
    c = start(clusters, "embedded", 1)
    with pytest.raises(tqstream.CheckpointNotFoundError, match=r"no checkpoint at .*nowhere"):
        c.load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    c.put(batch([0]), "p")
    with pytest.raises(tqstream.CheckpointError, match="exists and is not a tqstream checkpoint"):
        c.save_checkpoint(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(tqstream.InvalidRequestError, match="JSON"):
        c.save_checkpoint(tmp_path / "ck", metadata={"t": object()})
    c.save_checkpoint(tmp_path / "ck")
    with pytest.raises(tqstream.CheckpointError, match=r"holds rows \('p' \(1 rows\)\)"):
        c.load_checkpoint(tmp_path / "ck")
    c.put(batch([1, 2]), "p")
    assert c.save_checkpoint(tmp_path / "ck").rows == 3  # a checkpoint is replaced
    assert c.save_checkpoint(tmp_path / "empty-dir-ok").rows == 3
    assert sorted(os.listdir(tmp_path)) == ["ck", "empty-dir-ok", "mine"]


def _saved(clusters: list[Cluster], path: Path, units: int = 2) -> None:
    c = start(clusters, "embedded", units)
    c.put(batch(list(range(3))), "p")
    c.put(batch(list(range(3, 6))), "p")  # small puts go to the units in turn
    c.save_checkpoint(path)
    clusters[-1].crash()


def _as_declared(c: tqstream.Client) -> None:
    """The cluster as it was before a failed load: partition 'p' declared, empty; no bytes."""
    st = c.stats()
    assert list(st.partitions) == ["p"] and st.partitions["p"].rows == 0
    assert st.partitions["p"].tasks_registered == ["T"] and "zzz" in st.partitions["p"].fields
    assert st.storage_bytes == 0 and all(u.chunks == 0 for u in st.units)


def test_damaged_checkpoints_are_refused_and_nothing_is_kept(
    clusters: list[Cluster], tmp_path: Path
) -> None:
    _saved(clusters, tmp_path / "ck")
    c = start(clusters, "embedded", 2)
    c.create_partition("p", ["zzz"], tasks=["T"])  # declared at start-up: a load replaces it
    manifest = tmp_path / "ck" / "manifest.json"
    original = manifest.read_text()
    manifest.write_text(original.replace('"format": 1', '"format": 99'))
    with pytest.raises(tqstream.CheckpointVersionError, match="format 99; this tqstream reads"):
        c.load_checkpoint(tmp_path / "ck")
    manifest.write_text(original)
    state = tmp_path / "ck" / "controller.msgpack"
    raw = state.read_bytes()
    state.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(tqstream.CheckpointCorruptError, match=r"controller\.msgpack has"):
        c.load_checkpoint(tmp_path / "ck")
    state.write_bytes(raw)
    files = sorted((tmp_path / "ck").glob("unit-*/*.chunks"))
    assert len(files) == 2  # one per unit: one loads, the other fails
    chunks = files[1].read_bytes()
    os.truncate(files[1], files[1].stat().st_size - 1)
    with pytest.raises(tqstream.CheckpointCorruptError, match=r"storage unit 1 .*cut short"):
        c.load_checkpoint(tmp_path / "ck")
    _as_declared(c)
    files[1].unlink()
    with pytest.raises(tqstream.CheckpointNotFoundError, match="does not exist"):
        c.load_checkpoint(tmp_path / "ck")
    _as_declared(c)
    files[1].write_bytes(chunks)
    assert c.load_checkpoint(tmp_path / "ck").rows == 6
    st = c.stats().partitions["p"]
    assert st.rows == 6 and st.tasks_registered == [] and "zzz" not in st.fields
    json.loads(original)  # the manifest is plain JSON


def test_a_unit_that_dies_fails_the_save_and_the_old_checkpoint_stays(
    clusters: list[Cluster], tmp_path: Path
) -> None:
    c = start(clusters, "processes", 2)
    c.put(batch(list(range(4))), "p")
    assert c.save_checkpoint(tmp_path / "ck").rows == 4
    c.put(batch(list(range(4, 8))), "p")
    procs = clusters[-1].procs
    assert procs is not None
    units = c.stats().units  # in registration order, which is not the order they were started in
    held = [i for i, u in enumerate(units) if u.rows][-1]
    procs.procs[1 + procs.unit_addresses.index(units[held].address)].kill()
    with pytest.raises(tqstream.CheckpointError, match=f"storage unit {held} .*older one"):
        c.save_checkpoint(tmp_path / "ck", timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    clusters[-1].crash()
    c = start(clusters, "embedded", 2)
    assert c.load_checkpoint(tmp_path / "ck").rows == 4


def test_rows_kept_twice_are_restored_twice(clusters: list[Cluster], tmp_path: Path) -> None:
    """A partition with replicas=2 gets both copies back: after the load, killing a storage unit
    loses no row."""
    c = start(clusters, "processes", 2)
    c.create_partition("r", ["x"], replicas=2)
    for i in range(4):
        c.put({"x": torch.full((3, 8), float(i))}, "r")
    summary = c.save_checkpoint(tmp_path / "ck")
    assert summary.rows == 12
    clusters[-1].crash()
    c = start(clusters, "processes", 3)
    c.load_checkpoint(tmp_path / "ck")
    meta = c.get_meta("r", "x", 12, "t", timeout=5)
    assert all(r >= 0 and r != u for u, r in zip(meta.units, meta.replicas, strict=True))
    procs = clusters[-1].procs
    assert procs is not None
    victim = c.stats().units[meta.units[0]].address
    procs.procs[1 + procs.unit_addresses.index(victim)].kill()
    x = c.get_data(meta)["x"]  # from the copies
    assert sorted(x[:, 0].tolist()) == sorted(float(i) for i in range(4) for _ in range(3))
    c.ack(meta)
    assert c.stats("r").partitions["r"].lost == 0


def test_a_load_onto_a_unit_that_was_lost_and_came_back(
    clusters: list[Cluster], tmp_path: Path
) -> None:
    """A revived unit refuses chunks older than its revival; the loaded ones take new ids."""
    _saved(clusters, tmp_path / "ck")
    c = start(clusters, "processes", 2)
    procs = clusters[-1].procs
    assert procs is not None
    c.put(batch([0, 1]), "scratch")
    assert c.clear_partition("scratch")
    i = procs.unit_addresses.index(c.stats().units[0].address)
    procs.procs[1 + i].kill()
    _until(lambda: not c.stats().units[0].alive)
    procs.restart_unit(i)
    _until(lambda: c.stats().units[0].alive)
    assert c.load_checkpoint(tmp_path / "ck").rows == 6
    got = c.get("p", FIELDS, 6, "t", timeout=10)
    assert sorted(got.meta.keys) == sorted(c.list_keys("p")) and len(set(got.meta.units)) == 2
    check_rows(got, {k: i for i, k in enumerate(c.list_keys("p"))}, set())


def _until(what: Any, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
