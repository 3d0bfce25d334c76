"""The controller state through a checkpoint (``tqstream.controller.snapshot``): taken, encoded,
decoded and restored into a fresh state, no sockets. What is committed comes back exactly; what
was in flight (puts, put_fields, leases) does not; ids continue past the checkpoint."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from test_controller_state import F32, I64, get, new_state, prepare, put, put_fields, req

from tqstream.controller import restore as rebuild
from tqstream.controller.restore import assign_files, install, replaceable, restore
from tqstream.controller.snapshot import ControllerSnapshot, FileEntry, take
from tqstream.controller.state import ControllerState
from tqstream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    DuplicateKeyError,
    RequestTimeoutError,
    SchemaError,
    UnknownLeaseError,
)
from tqstream.protocol.messages import Acquire


def saved(s: ControllerState, now: float = 0.0) -> ControllerSnapshot:
    """The snapshot as a checkpoint holds it: one file per unit and partition, through msgpack."""
    taken = take(s, now)
    files = [
        FileEntry(unit, f"unit-{unit}/{name}", name, rows, 10 * len(rows))
        for unit, parts in taken.rows.items()
        for name, rows in parts.items()
    ]
    snap = msgspec.structs.replace(taken.snapshot, files=files)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=ControllerSnapshot)


def restored(snap: ControllerSnapshot, units: int = 2, now: float = 0.0) -> ControllerState:
    s = new_state(units)
    restore(s, snap, now)
    return s


def drain(s: ControllerState, task: str, fields: Any = ("a",), partition: str = "p") -> list[str]:
    """Every row ``task`` can be served now, in serving order, as keys (leased)."""
    keys: list[str] = []
    while True:
        try:
            meta = get(s, fields, 1, task, partition=partition, timeout=0.0)
        except RequestTimeoutError:
            return keys
        keys += meta.keys


def build() -> ControllerState:
    """Two partitions: groups, keys, versions, a put_fields; task A acked some, B leased some."""
    s = new_state(2)
    put(s, 4, ("a",), keys=["k0", "k1", "k2", "k3"], groups=["g0", "g0", "g1", "g1"], version=3)
    put(s, 3, ("a",), version=4, version_start=[1, 2, 3], version_end=[4, 4, 4])
    put_fields(s, [0, 1, 4], ("b",))
    put(s, 2, ("a",), partition="q")
    a = get(s, ("a",), 3, "A")
    s.ack("p", "A", a.lease_id, a.row_ids)
    get(s, ("a",), 2, "B")  # leased, never acked
    return s


def test_committed_state_comes_back_and_leases_become_available() -> None:
    s = build()
    back = restored(saved(s))
    before, after = s.stats(None), back.stats(None)
    assert before.keys() == after.keys()
    for name in before:
        b, a = before[name], after[name]
        assert (a.rows, a.fields, a.schemas, a.produced) == (
            b.rows,
            b.fields,
            b.schemas,
            b.produced,
        )
        for task, t in b.tasks.items():
            assert (a.tasks[task].acked, a.tasks[task].leased) == (t.acked, 0)
            assert a.tasks[task].available == t.available + t.leased
    for name, p in s.partitions.items():
        q = back.partitions[name]
        assert {q.key_of(r): i for i, r in q.rows.items()} == {
            p.key_of(r): i for i, r in p.rows.items()
        }
        assert {g: (v.size, v.members) for g, v in q.groups.items()} == {
            g: (v.size, v.members) for g, v in p.groups.items()
        }
        for rid, r in p.rows.items():
            o = q.rows[rid]
            got = (o.key, o.group, o.version_start, o.version_end, o.dispatch_version, o.written)
            want = (r.key, r.group, r.version_start, r.version_end, r.dispatch_version, r.written)
            assert got == want
        assert q.next_row == p.next_row and q.key_prefix == p.key_prefix
    assert back.units.bytes == s.units.bytes
    # each task is served exactly what it had not acked, in the order it would have been
    for lease in list(s.leases.values()):
        s.release(lease.partition, lease.task, lease.lease_id, sorted(lease.rows), 0.0)
    for task in ("A", "B", "C"):
        for fields in (("a", "b"), ("a",)):
            assert drain(back, task, fields) == drain(s, task, fields)
    assert drain(back, "C", partition="q") == drain(s, "C", partition="q") != []


def test_whole_groups_are_served_after_a_restore() -> None:
    s = new_state(1)
    put(s, 4, ("a",), groups=["g0", "g0", "g1", "g1"])
    back = restored(saved(s), 1)
    meta = get(back, ("a",), 4, "t", whole_groups=True)
    assert meta is not None and meta.groups == ["g0", "g0", "g1", "g1"]


def test_puts_and_put_fields_in_flight_are_left_out() -> None:
    s = new_state(2)
    put(s, 2, ("a",), keys=["x", "y"], nbytes=100)
    plan = prepare(s, 3, ("a",), keys=["z0", "z1", "z2"])  # never committed
    fields = put_fields(s, [0, 1], ("b",), nbytes=40, commit=False)
    taken = take(s, 0.0)
    pending = {c for segs in (plan.segments, fields.segments) for c in (x.chunk for x in segs)}
    assert {c for cs in taken.skip_chunks.values() for c in cs} == pending
    assert taken.before_chunk > max(pending)
    assert [r for parts in taken.rows.values() for r in parts.get("p", [])] == [0, 1]
    back = restored(saved(s))
    p = back.partitions["p"]
    assert sorted(map(p.key_of, p.rows.values())) == ["x", "y"]  # z0..z2 were never visible
    assert p.written_count == {"a": 2} and not any(r.pending for r in p.rows.values())
    assert sum(back.units.bytes) == 100  # without the put_fields' 40 bytes
    assert back.stats("p")["p"].pending_puts == 0
    put(back, 1, ("a",), keys=["z0"])  # a retried put of the lost rows


def test_ids_continue_past_the_checkpoint() -> None:
    s = build()
    snap = saved(s)
    back = restored(snap)
    old_leases = list(s.leases)
    plan = prepare(back, 2, ("a",))
    assert min(plan.rows()) >= s.partitions["p"].next_row
    assert min(seg.chunk for seg in plan.segments) >= snap.next_id  # every saved one is below
    meta = get(back, ("a",), 1, "Z")
    assert meta.lease_id > max(old_leases)
    with pytest.raises(DuplicateKeyError):
        put(back, 1, ("a",), keys=["k0"])
    with pytest.raises(UnknownLeaseError, match="restarted"):  # a lease of the saved cluster
        back.ack("p", "B", old_leases[-1], [0])


@pytest.mark.parametrize("units", [1, 3])
def test_another_number_of_units_takes_every_row(units: int) -> None:
    s = build()
    back = restored(saved(s), units)
    assert sum(back.units.bytes) == sum(s.units.bytes)
    assert all(0 <= r.unit < units for p in back.partitions.values() for r in p.rows.values())
    assert drain(back, "C") == drain(s, "C")


def test_files_are_spread_by_bytes_or_kept_on_their_unit() -> None:
    sizes = [(0, 5), (1, 9), (0, 4), (1, 1)]
    files = [FileEntry(u, f"f{i}", "p", [i], n) for i, (u, n) in enumerate(sizes)]
    one, two = [1] * 4, [2] * 4
    assert assign_files(files, 2, [True, True], one) == [(0, -1), (1, -1), (0, -1), (1, -1)]
    assert [u for u, _ in assign_files(files, 2, [True] * 3, one)] == [1, 0, 2, 2]
    assert assign_files(files, 2, [True], two) == [(0, -1)] * 4  # one unit: one copy
    assert [u for u, _ in assign_files(files, 2, [False, True, True], one)] == [2, 1, 2, 1]
    assert assign_files(files, 2, [True, True], two) == [(0, 1), (1, 0), (0, 1), (1, 0)]
    with pytest.raises(CheckpointError, match="no live storage unit"):
        assign_files(files, 2, [False, False], one)


def test_a_partition_keeping_two_copies_is_restored_with_two() -> None:
    s = new_state(2)
    s.create_partition("p", [], replicas=2)
    put(s, 4, ("a",), nbytes=40)
    assert all(r.replica >= 0 for r in s.partitions["p"].rows.values())
    back = restored(saved(s), 3)
    rows = back.partitions["p"].rows.values()
    assert all(r.replica >= 0 and r.replica != r.unit for r in rows)
    assert sum(back.units.bytes) == 80 and back.stats("p")["p"].replicas == 2
    back.lose_unit(next(iter(rows)).unit, 0.0)
    assert back.stats("p")["p"].rows == 4  # served from the copies


def test_a_unit_lost_while_loading_fails_the_install() -> None:
    snap = saved(build())
    fresh = new_state(2)
    ready = rebuild.prepare(fresh, snap, rebuild.placement(fresh, snap))
    fresh.lose_unit(1, 0.0)
    fresh.add_unit("tcp://unit1")  # back, empty: what it loaded is gone
    with pytest.raises(CheckpointError, match=r"storage unit\(s\) \[1\] were lost while"):
        install(fresh, ready, 0.0, {})
    assert fresh.partitions == {}


def test_a_ttl_keeps_the_time_it_had_left() -> None:
    s = new_state(1)
    s.create_partition("p", [], ttl=10.0)
    put(s, 2, ("a",), now=0.0)
    back = restored(saved(s, now=4.0), 1, now=100.0)
    assert back.next_deadline() == pytest.approx(106.0)
    back.expire(105.9)
    assert back.stats("p")["p"].rows == 2
    effects = back.expire(106.1)
    assert back.stats("p")["p"].expired == 2 and effects.drop_rows


def test_registered_tasks_still_free_rows() -> None:
    s = new_state(1)
    s.create_partition("p", ["a"], tasks=["A", "B"])
    put(s, 2, ("a",))
    m = get(s, ("a",), 2, "A")
    s.ack("p", "A", m.lease_id, m.row_ids)
    back = restored(saved(s), 1)
    m = get(back, ("a",), 2, "B")
    _, effects = back.ack("p", "B", m.lease_id, m.row_ids)
    assert back.stats("p")["p"].rows == 0 and effects.drop_rows == {0: {"p": [0, 1]}}
    assert back.units.bytes == [0]


def test_closed_partitions_and_counters_come_back() -> None:
    s = new_state(1)
    s.create_partition("p", ["a"], producers=2)
    put(s, 1, ("a",), rejected=3)
    s.close_partition("p", 0.0)
    back = restored(saved(s), 1)
    st = back.stats("p")["p"]
    assert (st.producers_open, st.rejected, st.produced) == (1, 3, 1)


def test_admissions_continue_with_their_slots() -> None:
    s = new_state(1)
    s.create_admission("q", "slots", {"max_pending_slots": 4, "max_version_slots": 8})
    ids = s.acquire(Acquire(rid=0, name="q", n=3), 0.0)
    assert ids == [1, 2, 3]
    s.release_slots("q", [1], "accepted")
    back = restored(saved(s), 1)
    assert back.admission_stats() == s.admission_stats()
    assert back.acquire(Acquire(rid=0, name="q", n=4, wait=False), 0.0) == [4, 5]  # 2 running
    back.release_slots("q", [2, 3], "accepted")  # the slots granted before the save
    assert back.admission_stats()["q"]["running"] == 2


def test_masks_beyond_64_fields() -> None:
    s = new_state(1)
    fields = [f"f{i}" for i in range(70)]
    put(s, 2, fields)
    back = restored(saved(s), 1)
    assert back.partitions["p"].rows[0].written == (1 << 70) - 1
    assert drain(back, "t", fields) == drain(s, "t", fields)


def _damaged(snap: ControllerSnapshot, **rows: Any) -> ControllerSnapshot:
    p = snap.partitions[0]
    table = msgspec.structs.replace(p.rows, **rows)
    return msgspec.structs.replace(snap, partitions=[msgspec.structs.replace(p, rows=table)])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda snap: msgspec.structs.replace(snap, files=snap.files[1:]), "in no storage unit"),
        (lambda snap: _damaged(snap, keys=["k0"] * 7), "repeats"),
        (lambda snap: _damaged(snap, written=[1 << 9] * 7), "fields it does not have"),
        (lambda snap: _damaged(snap, ids=[0, 1]), "different lengths"),
        (lambda snap: _damaged(snap, ids=[0] * 7), "a row id twice or out of its range"),
        (lambda snap: _damaged(snap, version_start=[2**40] * 7), "version_start out of range"),
        (lambda snap: msgspec.structs.replace(snap, files=snap.files * 2), "in two files"),
    ],
)
def test_an_inconsistent_snapshot_is_refused_and_changes_nothing(damage: Any, message: str) -> None:
    s = build()
    snap = damage(saved(s))
    fresh = new_state(2)
    with pytest.raises(CheckpointCorruptError, match=message):
        restore(fresh, snap, 0.0)
    assert fresh.partitions == {} and fresh.units.bytes == [0, 0]


def test_a_partition_created_meanwhile_is_a_clash() -> None:
    snap = saved(build())
    fresh = new_state(2)
    put(fresh, 1, ("a",), partition="q")
    with pytest.raises(CheckpointError, match=r"'q' of the checkpoint were put to while"):
        restore(fresh, snap, 0.0)
    assert list(fresh.partitions) == ["q"] and fresh.partitions["q"].committed == 1


def test_empty_partitions_of_the_same_name_are_replaced_unless_put_to_meanwhile() -> None:
    snap = saved(build())
    fresh = new_state(2)
    fresh.create_partition("p", ["a", "zzz"], tasks=["T"])  # declared at start-up, empty
    handle = object()
    assert fresh.get_meta(req(("a",), 1, "T"), handle, 0.0)[0] is None  # a get waits on it
    effects = restore(fresh, snap, 0.0)
    assert [h for h, _ in effects.failed] == [handle] and not effects.drop_partitions
    assert "zzz" not in fresh.partitions["p"].bits and fresh.partitions["p"].registered == []
    assert fresh.stats("p")["p"].rows == 7

    fresh = new_state(2)
    fresh.create_partition("p", ["a"])
    empty = replaceable(fresh, snap)  # when the load begins
    ready = rebuild.prepare(fresh, snap, rebuild.placement(fresh, snap))
    put(fresh, 1, ("a",))  # a producer, while the units load
    with pytest.raises(CheckpointError, match="'p' of the checkpoint were put to while it"):
        install(fresh, ready, 0.0, empty)
    assert fresh.stats("p")["p"].rows == 1 and "q" not in fresh.partitions


def test_groups_are_checked_before_anything_changes() -> None:
    snap = saved(build())
    p = snap.partitions[0]
    bad = msgspec.structs.replace(p, groups=[msgspec.structs.replace(p.groups[0], members=[99])])
    snap = msgspec.structs.replace(snap, partitions=[bad, *snap.partitions[1:]])
    fresh = new_state(2)
    with pytest.raises(CheckpointCorruptError, match="unknown members"):
        restore(fresh, snap, 0.0)
    assert fresh.partitions == {}


def test_an_admission_that_granted_slots_here_refuses_the_load() -> None:
    s = new_state(1)
    s.create_admission("q", "slots", {"max_pending_slots": 4, "max_version_slots": 8})
    snap = saved(s)
    fresh = new_state(1)
    fresh.create_admission("q", "slots", {"max_pending_slots": 4, "max_version_slots": 8})
    fresh.acquire(Acquire(rid=0, name="q", n=1), 0.0)
    with pytest.raises(CheckpointError, match=r"admission 'q' of the checkpoint exists in this "):
        restore(fresh, snap, 0.0)
    assert fresh.admission_stats()["q"]["running"] == 1  # unchanged


def test_a_restored_schema_outlives_writes_that_roll_back_or_are_refused() -> None:
    """A field's schema fixed before a checkpoint stays fixed after the restore though no row
    holds the field: neither a put of it that rolls back nor one refused at prepare forgets it,
    so a later put of another schema is still refused."""
    s = new_state(2)
    meta = put(s, 2, ("a",), keys=["k0", "k1"])
    s.clear_samples("p", meta.row_ids)
    back = restored(saved(s))
    assert back.stats("p")["p"].schemas == {"a": F32}
    back.abort(prepare(back, 2, ("a",)).put_id)
    put(back, 1, ("b",), keys=["taken"])
    with pytest.raises(DuplicateKeyError):
        prepare(back, 1, ("a",), keys=["taken"])
    assert back.stats("p")["p"].schemas == {"a": F32, "b": F32}
    with pytest.raises(SchemaError, match="stored as dense float32"):
        prepare(back, 1, {"a": I64})


def test_a_schema_of_a_put_in_flight_is_not_in_the_snapshot() -> None:
    """The put in flight does not come back, and neither does the schema only it fixed."""
    s = new_state(2)
    put(s, 1, ("a",))
    prepare(s, 1, ("a", "new"))
    back = restored(saved(s))
    assert back.stats("p")["p"].schemas == {"a": F32}
    put(back, 1, {"a": F32, "new": I64})  # another schema for it is fine


def test_a_user_key_in_the_generated_name_of_a_row_to_come_survives_a_restore() -> None:
    s = new_state()
    prefix = put(s, 1).keys[0][:-1]  # row 0
    put(s, 1, keys=[f"{prefix}3"])  # row 1 takes the name row 3 would be generated
    back = restored(saved(s))
    assert back.partitions["p"].rows[0].key is None  # generated keys stay unstored
    put(back, 1)  # row 2
    assert put(back, 1).keys == [f"{prefix}3.1"]  # row 3
    keys = back.list_keys("p")
    assert len(set(keys)) == len(keys) == 4
