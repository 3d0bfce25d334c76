"""Example tests of the controller's pure state (``tqstream.controller.state``): no sockets, no
clock. Every test drives :class:`ControllerState` directly with explicit ``now`` values."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from tqstream.controller.partition import Partition
from tqstream.controller.state import ControllerState, Effects
from tqstream.errors import (
    CapacityError,
    DuplicateKeyError,
    FieldExistsError,
    GroupError,
    InvalidRequestError,
    LeaseError,
    LeaseExpiredError,
    NotReadyError,
    PartitionClearedError,
    RequestTimeoutError,
    SchemaError,
    UnknownFieldError,
    UnknownKeyError,
    UnknownLeaseError,
    UnknownPartitionError,
    UnknownRowError,
)
from tqstream.protocol.messages import GetMeta, PrepareFields, PreparePut, PutPlan
from tqstream.types import BatchMeta, FieldSchema

F32 = FieldSchema("dense", "float32", (2,))
I64 = FieldSchema("dense", "int64", (2,))
LEASE = 100.0
PUT = 10.0

_handles = itertools.count()


# --- helpers ---
def new_state(units: int = 2) -> ControllerState:
    s = ControllerState(lease_timeout=LEASE, put_timeout=PUT)
    for u in range(units):
        s.add_unit(f"tcp://unit{u}")
    return s


def prepare(
    s: ControllerState,
    n: int,
    fields: Any = ("a",),
    partition: str = "p",
    now: float = 0.0,
    nbytes: int | None = None,
    **kw: Any,
) -> PutPlan:
    schemas = fields if isinstance(fields, dict) else {f: F32 for f in fields}
    req = PreparePut(
        rid=0,
        partition=partition,
        n_rows=n,
        schemas=schemas,
        nbytes=10 * n if nbytes is None else nbytes,
        **kw,
    )
    return s.prepare_put(req, now)


def put(s: ControllerState, n: int, fields: Any = ("a",), **kw: Any) -> BatchMeta:
    now = kw.get("now", 0.0)
    meta, _ = s.commit(prepare(s, n, fields, **kw).put_id, now)
    assert meta is not None
    return meta


def put_fields(
    s: ControllerState,
    row_ids: list[int],
    fields: Any = ("b",),
    partition: str = "p",
    now: float = 0.0,
    nbytes: int | None = None,
    commit: bool = True,
) -> Any:
    schemas = fields if isinstance(fields, dict) else {f: F32 for f in fields}
    req = PrepareFields(
        rid=0,
        partition=partition,
        row_ids=row_ids,
        schemas=schemas,
        nbytes=5 * len(row_ids) if nbytes is None else nbytes,
    )
    plan = s.prepare_fields(req, now)
    if commit:
        return s.commit(plan.put_id, now)
    return plan


def req(
    fields: Any = ("a",), batch_size: int = 1, task: str = "actor", partition: str = "p", **kw: Any
) -> GetMeta:
    return GetMeta(
        rid=0, partition=partition, fields=list(fields), batch_size=batch_size, task=task, **kw
    )


def get(s: ControllerState, *args: Any, now: float = 0.0, handle: Any = None, **kw: Any) -> Any:
    """``get_meta``'s rows, or None when it parked; a get that cannot wait raises its error."""
    handle = next(_handles) if handle is None else handle
    meta, effects = s.get_meta(req(*args, **kw), handle, now)
    for to, error in effects.failed:
        if to == handle:
            raise error
    return meta


def snapshot(s: ControllerState) -> Any:
    return (
        s.stats(None),
        list(s.units.bytes),
        {n: sorted(p.bits.items()) for n, p in s.partitions.items()},
        {n: {p.key_of(r): rid for rid, r in p.rows.items()} for n, p in s.partitions.items()},
        {
            n: {g: (v.size, list(v.members)) for g, v in p.groups.items()}
            for n, p in s.partitions.items()
        },
        {n: p.next_row for n, p in s.partitions.items()},
        len(s.puts),
        len(s.leases),
    )


def task_stats(s: ControllerState, task: str, partition: str = "p") -> tuple[int, int, int]:
    t = s.stats(partition)[partition].tasks[task]
    return t.available, t.leased, t.acked


# --- two-phase put ---
def test_prepared_rows_are_invisible_until_commit() -> None:
    s = new_state()
    plan = prepare(s, 3, keys=["x", "y", "z"])
    assert s.list_keys("p") == []
    assert s.stats("p")["p"].rows == 0
    assert s.stats("p")["p"].pending_puts == 1
    with pytest.raises(UnknownKeyError):
        s.get_by_keys("p", ["x"], None)
    assert get(s, handle="h") is None  # parked
    meta, effects = s.commit(plan.put_id, 1.0)
    assert meta is not None and meta.keys == ["x", "y", "z"] and meta.row_ids == list(plan.rows())
    assert s.list_keys("p") == ["x", "y", "z"]
    assert [h for h, _ in effects.served] == ["h"]
    assert effects.served[0][1].row_ids == [plan.rows()[0]]
    assert s.stats("p")["p"].pending_puts == 0


def test_put_plan_covers_every_row_once() -> None:
    s = new_state(units=3)
    plan = prepare(s, 7, nbytes=3 * (64 << 20))  # big enough to split over every unit
    assert plan.segments[0].start == 0 and plan.segments[-1].stop == 7
    for a, b in itertools.pairwise(plan.segments):
        assert a.stop == b.start
    assert len({seg.unit for seg in plan.segments}) == 3
    assert sum(s.units.bytes) == (3 * (64 << 20)) // 7 * 7


def test_abort_leaves_no_rows_keys_groups_schemas_or_bytes() -> None:
    s = new_state()
    put(s, 1, keys=["old"])
    before = snapshot(s)
    plan = prepare(
        s, 3, ("a", "new"), keys=["k0", "k1", "k2"], groups=["g", "g", None], group_size=3
    )
    assert sum(s.units.bytes) == 40
    effects = s.abort(plan.put_id)
    assert {c for chunks in effects.drop_chunks.values() for c in chunks} == {
        seg.chunk for seg in plan.segments
    }
    assert not effects.served and not effects.drop_rows
    assert s.stats("p")["p"].rows == 1
    assert "new" not in s.stats("p")["p"].schemas
    assert "g" not in s.partitions["p"].groups
    assert sum(s.units.bytes) == 10
    # the keys, the group name and the field name are free again, with another schema
    put(s, 2, {"a": F32, "new": I64}, keys=["k0", "k1"], groups=["g", "g"])
    assert s.partitions["p"].groups["g"].size == 2
    assert s.abort(plan.put_id) == Effects()  # a second abort is a no-op
    assert sorted(before[1]) == [0, 10]  # the bytes of the one committed row, before the put


def test_put_expires_at_put_timeout_and_late_commit_fails() -> None:
    s = new_state()
    plan = prepare(s, 2, keys=["x", "y"], now=0.0)
    assert s.next_deadline() == PUT
    assert s.expire(PUT - 0.5) == Effects()
    effects = s.expire(PUT)
    assert sorted(c for cs in effects.drop_chunks.values() for c in cs) == [
        seg.chunk for seg in plan.segments
    ]
    assert s.stats("p")["p"].rows == 0 and s.stats("p")["p"].pending_puts == 0
    assert s.units.bytes == [0, 0]
    assert s.stats("p")["p"].schemas == {}
    with pytest.raises(RequestTimeoutError) as err:
        s.commit(plan.put_id, PUT + 1)
    assert str(err.value) == (
        f"put {plan.put_id} was not committed within put_timeout={PUT}s and was rolled back "
        f"(no rows, no bytes kept); retry the put"
    )
    put(s, 1, keys=["x"])  # the key is free again


def test_commit_unknown_or_repeated_put() -> None:
    s = new_state()
    plan = prepare(s, 1)
    s.commit(plan.put_id, 0.0)
    with pytest.raises(
        InvalidRequestError, match=f"put {plan.put_id} is unknown or already committed"
    ):
        s.commit(plan.put_id, 0.0)
    with pytest.raises(InvalidRequestError, match="put 12345 is unknown or already finished"):
        s.commit(12345, 0.0)


def test_aborted_put_keeps_schema_fixed_by_an_earlier_put_whose_rows_were_cleared() -> None:
    s = new_state()
    meta = put(s, 1, keys=["x"])
    s.clear_samples("p", meta.row_ids)
    assert s.stats("p")["p"].schemas == {"a": F32}
    s.abort(prepare(s, 1).put_id)
    # the aborted put did not fix 'a': its schema must survive
    assert s.stats("p")["p"].schemas == {"a": F32}
    with pytest.raises(SchemaError):
        prepare(s, 1, {"a": I64})


def test_two_pending_puts_of_a_new_field_both_aborted_leave_no_schema() -> None:
    s = new_state()
    put(s, 1)
    p1 = prepare(s, 1, ("a", "n"))
    p2 = prepare(s, 1, ("a", "n"))
    s.abort(p1.put_id)
    assert s.stats("p")["p"].schemas["n"] == F32  # still being written by p2
    s.abort(p2.put_id)
    assert "n" not in s.stats("p")["p"].schemas


# --- validation errors: exact messages, state unchanged ---
def test_unknown_partition() -> None:
    s = new_state()
    with pytest.raises(UnknownPartitionError) as err:
        get(s, partition="nope")
    assert str(err.value) == (
        "partition 'nope' does not exist (existing: none); put to it first, or declare it with "
        "create_partition('nope', fields=[...]) so that gets wait for producers"
    )
    put(s, 1)
    with pytest.raises(UnknownPartitionError) as err:
        s.list_keys("nope")
    assert "(existing: 'p')" in str(err.value)
    assert isinstance(err.value, KeyError)


def test_unknown_field() -> None:
    s = new_state()
    put(s, 1)
    before = snapshot(s)
    with pytest.raises(UnknownFieldError) as err:
        get(s, ("a", "rewards"))
    assert str(err.value) == (
        "field 'rewards' is not in partition 'p' (known fields: 'a'); put it first or declare it "
        "with create_partition('p', fields=[...]) so requests wait for it"
    )
    assert snapshot(s) == before


def test_declared_field_makes_gets_wait() -> None:
    s = new_state()
    s.create_partition("p", ["a", "b"])
    assert get(s, ("b",), handle="h") is None
    plan = prepare(s, 1, ("a", "b"))
    _, effects = s.commit(plan.put_id, 0.0)
    assert [h for h, _ in effects.served] == ["h"]


@pytest.mark.parametrize("batch_size", [0, -3])
def test_batch_size_must_be_positive(batch_size: int) -> None:
    s = new_state()
    put(s, 2)
    before = snapshot(s)
    with pytest.raises(InvalidRequestError) as err:
        get(s, batch_size=batch_size)
    assert str(err.value) == f"batch_size must be a positive number of rows, got {batch_size}"
    assert snapshot(s) == before


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"fields": []}, "get_meta needs at least one field to wait for"),
        ({"task": ""}, "get_meta needs a task name (e.g. task='actor')"),
        ({"timeout": -1.0}, "timeout must be >= 0 or None, got -1.0"),
        ({"lease_timeout": 0.0}, "lease_timeout must be > 0, got 0.0"),
    ],
)
def test_get_meta_argument_errors(kw: dict[str, Any], message: str) -> None:
    s = new_state()
    put(s, 2)
    before = snapshot(s)
    with pytest.raises(InvalidRequestError) as err:
        get(s, **kw)
    assert str(err.value) == message
    assert snapshot(s) == before


def test_duplicate_key_with_existing_key() -> None:
    s = new_state()
    put(s, 2, keys=["x", "y"])
    before = snapshot(s)
    with pytest.raises(DuplicateKeyError) as err:
        prepare(s, 2, ("a", "b"), keys=["z", "y"])
    assert str(err.value) == (
        "1 key(s) already exist in partition 'p' or repeat within the put: 'y'; keys must be "
        "unique per partition (omit keys to have them generated)"
    )
    assert snapshot(s) == before  # including: field 'b' was not added


def test_duplicate_key_within_the_put() -> None:
    s = new_state()
    put(s, 1)
    before = snapshot(s)
    with pytest.raises(DuplicateKeyError, match=r"repeat within the put: 'q'; keys must"):
        prepare(s, 3, keys=["q", "r", "q"])
    assert snapshot(s) == before


def test_duplicate_key_with_a_pending_put() -> None:
    s = new_state()
    prepare(s, 1, keys=["x"])
    before = snapshot(s)
    with pytest.raises(DuplicateKeyError):
        prepare(s, 1, keys=["x"])
    assert snapshot(s) == before


def test_generated_keys_never_collide_with_user_keys() -> None:
    s = new_state()
    prefix = put(s, 1).keys[0][:-1]  # generated keys are '<prefix><row id>'
    put(s, 1, keys=[f"{prefix}2"])  # a user key that looks like the next generated one
    generated = put(s, 1).keys[0]  # row 2
    assert generated != f"{prefix}2"
    keys = s.list_keys("p")
    assert len(set(keys)) == len(keys) == 3
    s.clear_samples("p", [0, 1, 2])
    assert s.list_keys("p") == [] and s.stats("p")["p"].rows == 0


def test_generated_keys_are_not_stored_and_answer_like_user_keys() -> None:
    s = new_state()
    generated = put(s, 3).keys  # rows 0-2
    prefix = generated[0][:-1]
    p = s.partitions["p"]
    assert all(r.key is None for r in p.rows.values())  # derived from the row id when asked
    assert [p.row_of_key(k).id for k in generated] == [0, 1, 2]  # type: ignore[union-attr]
    # not the generated form: a leading zero, another prefix, a sign, non-ASCII digits
    for other in (f"{prefix}01", f"x{prefix}1", f"{prefix}-1", f"{prefix}\u0661", prefix):
        assert p.row_of_key(other) is None
    with pytest.raises(DuplicateKeyError):
        put(s, 1, keys=[generated[1]])
    # a user key taking the generated name of a row to come (row 5): row 5 gets another one
    put(s, 1, keys=[f"{prefix}5"])  # row 3
    put(s, 1, keys=[f"{prefix}1.1"])  # row 4
    assert put(s, 1).keys == [f"{prefix}5.1"]  # row 5
    assert p.row_of_key(f"{prefix}5").id == 3 and p.row_of_key(f"{prefix}5.1").id == 5  # type: ignore[union-attr]
    # a removed row's generated name is free for a user key, and gone from the index
    s.clear_samples("p", [0])
    assert p.row_of_key(generated[0]) is None
    put(s, 1, keys=[generated[0]])  # row 6
    assert p.row_of_key(generated[0]).id == 6  # type: ignore[union-attr]
    keys = s.list_keys("p")
    assert len(set(keys)) == len(keys) == 6
    got = s.get_by_keys("p", keys, ["a"])
    assert got.keys == keys


def test_a_row_written_once_keeps_no_write_records() -> None:
    s = new_state()
    put(s, 2, fields=("a",))
    p = s.partitions["p"]
    assert all(r.writes is None for r in p.rows.values())
    put_fields(s, [0], {"b": F32})
    r0, r1 = p.rows[0], p.rows[1]
    assert r1.writes is None and [m for m, _ in p.writes_of(r1)] == [p.bits["a"]]
    assert [m for m, _ in p.writes_of(r0)] == [p.bits["a"], p.bits["b"]]
    # ready for "a" when "a" was written, for "a" and "b" when "b" was
    assert get(s, ("a",), batch_size=2).row_ids == [0, 1]
    assert get(s, ("a", "b"), batch_size=1, task="u").row_ids == [0]


def test_refused_put_to_a_new_partition_creates_nothing() -> None:
    s = new_state()
    with pytest.raises(DuplicateKeyError):
        prepare(s, 2, keys=["x", "x"], partition="fresh")
    with pytest.raises(GroupError):
        prepare(s, 2, groups=["g", "g"], group_size=1, partition="fresh")
    assert s.stats(None) == {}
    assert s.units.bytes == [0, 0]
    with pytest.raises(UnknownPartitionError):
        get(s, partition="fresh")


def test_schema_mismatch() -> None:
    s = new_state()
    put(s, 1)
    before = snapshot(s)
    with pytest.raises(SchemaError) as err:
        prepare(s, 1, {"b": F32, "a": I64})
    assert str(err.value) == (
        "field 'a' of partition 'p' is stored as dense float32[2] but this write offers dense "
        "int64[2]; convert the data to the stored schema or write it under a new field name"
    )
    assert snapshot(s) == before


def test_schema_mismatch_with_a_pending_put() -> None:
    s = new_state()
    put(s, 1)
    prepare(s, 1, ("b",))
    with pytest.raises(SchemaError):
        prepare(s, 1, {"b": I64})


def test_group_overflow() -> None:
    s = new_state()
    put(s, 2, groups=["g", "g"])
    before = snapshot(s)
    with pytest.raises(GroupError) as err:
        prepare(s, 1, ("a", "b"), groups=["g"])
    assert str(err.value) == (
        "group 'g' of partition 'p' holds 2 rows at most but this put would make it 3; pass "
        "group_size= at the group's first put to build a group over several puts"
    )
    assert snapshot(s) == before


def test_group_overflow_counts_pending_rows() -> None:
    s = new_state()
    prepare(s, 2, groups=["g", None], group_size=2)
    prepare(s, 1, groups=["g"], group_size=2)
    before = snapshot(s)
    with pytest.raises(GroupError, match="would make it 3"):
        prepare(s, 1, groups=["g"], group_size=2)
    assert snapshot(s) == before


def test_group_size_mismatch() -> None:
    s = new_state()
    put(s, 1, groups=["g"], group_size=4)
    before = snapshot(s)
    with pytest.raises(GroupError) as err:
        prepare(s, 1, groups=["g"], group_size=3)
    assert str(err.value) == (
        "group 'g' of partition 'p' was declared with 4 rows but this put declares group_size=3"
    )
    assert snapshot(s) == before


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"n": 0}, "a put needs at least one row and one field (got 0 rows, 1 fields)"),
        ({"fields": {}}, "a put needs at least one row and one field (got 2 rows, 0 fields)"),
        ({"keys": ["x"]}, "keys= has 1 entries but the put has 2 rows"),
        ({"groups": ["g"]}, "groups= has 1 entries but the put has 2 rows"),
        ({"group_size": 0}, "group_size must be positive, got 0"),
    ],
)
def test_put_argument_errors(kw: dict[str, Any], message: str) -> None:
    s = new_state()
    put(s, 1)
    before = snapshot(s)
    n = kw.pop("n", 2)
    with pytest.raises(InvalidRequestError) as err:
        prepare(s, n, kw.pop("fields", ("a",)), **kw)
    assert str(err.value) == message
    assert snapshot(s) == before


def test_put_fields_over_an_existing_field() -> None:
    s = new_state()
    meta = put(s, 3, ("a", "b"), keys=["x", "y", "z"])
    before = snapshot(s)
    with pytest.raises(FieldExistsError) as err:
        put_fields(s, meta.row_ids[1:], ("c", "b"))
    assert str(err.value) == (
        "field 'b' is already written (or being written) for 2 of the 2 rows in partition 'p' "
        "(e.g. key 'y'); fields cannot be overwritten: write the new values under another name"
    )
    assert snapshot(s) == before


def test_put_fields_schema_mismatch() -> None:
    s = new_state()
    meta = put(s, 2)
    put_fields(s, meta.row_ids[:1], {"b": F32})
    before = snapshot(s)
    with pytest.raises(SchemaError, match="field 'b' of partition 'p' is stored as dense float32"):
        put_fields(s, meta.row_ids[1:], {"c": F32, "b": I64})
    assert snapshot(s) == before


def test_put_fields_over_a_field_being_written() -> None:
    s = new_state()
    meta = put(s, 2)
    put_fields(s, meta.row_ids[:1], ("b",), commit=False)
    before = snapshot(s)
    with pytest.raises(FieldExistsError, match="for 1 of the 2 rows"):
        put_fields(s, meta.row_ids, ("b",))
    assert snapshot(s) == before


def test_put_fields_errors() -> None:
    s = new_state()
    meta = put(s, 2)
    pending = prepare(s, 1)
    before = snapshot(s)
    with pytest.raises(UnknownRowError) as err:
        put_fields(s, [meta.row_ids[0], 99, pending.rows()[0]])
    assert str(err.value) == (
        "2 of 3 rows no longer exist in partition 'p' (cleared since the metadata was obtained)"
    )
    with pytest.raises(InvalidRequestError, match="put_fields needs at least one row"):
        put_fields(s, [])
    with pytest.raises(UnknownPartitionError):
        put_fields(s, [0], partition="nope")
    assert snapshot(s) == before


def test_put_fields_refuses_repeated_rows() -> None:
    """A meta may repeat a row (get_by_keys with a repeated key); writing a field twice to one
    row would count it twice in the production matrix and in the bytes."""
    s = new_state()
    m = put(s, 2, keys=["x", "y"])
    repeated = s.get_by_keys("p", ["x", "y", "x"], None)
    assert repeated.row_ids == [m.row_ids[0], m.row_ids[1], m.row_ids[0]]
    before = snapshot(s)
    with pytest.raises(InvalidRequestError) as err:
        put_fields(s, repeated.row_ids, ("b",), nbytes=30)
    assert str(err.value) == (
        f"put_fields names row {m.row_ids[0]} more than once; a field is written once per row"
    )
    assert snapshot(s) == before


def test_get_by_keys() -> None:
    s = new_state()
    m = put(s, 3, ("a",), keys=["x", "y", "z"], version=7)
    put_fields(s, m.row_ids[:2], ("b",))
    meta = s.get_by_keys("p", ["y", "x"], None)
    assert meta.keys == ["y", "x"] and meta.row_ids == [m.row_ids[1], m.row_ids[0]]
    assert meta.fields == ["a", "b"] and meta.lease_id is None and meta.task is None
    assert meta.version_start == [7, 7]
    assert s.get_by_keys("p", ["z", "x"], None).fields == ["a"]
    with pytest.raises(UnknownKeyError) as err:
        s.get_by_keys("p", ["x", "w", "v"], ["a"])
    assert str(err.value) == "2 of 3 keys are not in partition 'p': 'w', 'v'"
    with pytest.raises(NotReadyError) as nerr:
        s.get_by_keys("p", ["x", "z"], ["b"])
    assert str(nerr.value) == (
        "field 'b' is not written for 1 of the requested rows of partition 'p' (e.g. key 'z')"
    )
    with pytest.raises(UnknownFieldError):
        s.get_by_keys("p", ["x"], ["nope"])
    many = [f"m{i}" for i in range(7)]
    with pytest.raises(UnknownKeyError, match=re.escape("'m0', 'm1', 'm2', 'm3', 'm4' ...")):
        s.get_by_keys("p", many, None)


# --- consumption: available -> leased -> acked ---
def test_lease_ack_lifecycle() -> None:
    s = new_state()
    put(s, 4)
    m = get(s, batch_size=3)
    assert m.task == "actor" and m.lease_id is not None and m.row_ids == [0, 1, 2]
    assert task_stats(s, "actor") == (1, 3, 0)
    assert s.ack("p", "actor", m.lease_id, m.row_ids[:1])[0] == 1  # partial ack
    assert task_stats(s, "actor") == (1, 2, 1)
    assert s.ack("p", "actor", m.lease_id, m.row_ids)[0] == 2  # the rest (row 0 again: harmless)
    assert task_stats(s, "actor") == (1, 0, 3)
    assert s.ack("p", "actor", m.lease_id, m.row_ids)[0] == 0  # ack twice: harmless
    m2 = get(s, batch_size=1)
    assert m2.row_ids == [3]
    assert get(s, batch_size=1, timeout=None) is None  # acked rows never come back


def test_tasks_are_independent() -> None:
    s = new_state()
    put(s, 2)
    a = get(s, batch_size=2, task="actor")
    s.ack("p", "actor", a.lease_id, a.row_ids)
    c = get(s, batch_size=2, task="critic")
    assert c.row_ids == a.row_ids
    assert task_stats(s, "critic") == (0, 2, 0)
    assert task_stats(s, "actor") == (0, 0, 2)
    with pytest.raises(LeaseError):
        s.ack("p", "critic", a.lease_id, a.row_ids)  # a finished lease of another task
    with pytest.raises(UnknownLeaseError) as err:
        s.ack("p", "actor", c.lease_id, c.row_ids)
    assert str(err.value) == (
        f"lease {c.lease_id} belongs to task 'critic' of partition 'p', not to task 'actor' of 'p'"
    )


def test_release_returns_rows_to_their_old_place() -> None:
    s = new_state()
    put(s, 4)
    m = get(s, batch_size=2)
    n, effects = s.release("p", "actor", m.lease_id, [m.row_ids[0]], 1.0)
    assert n == 1 and not effects
    m2 = get(s, batch_size=2)
    assert m2.row_ids == [0, 2]  # row 0 first again
    assert s.release("p", "actor", m.lease_id, [1], 1.0)[0] == 1  # lease m ends released
    with pytest.raises(LeaseError) as err:
        s.ack("p", "actor", m.lease_id, [1])
    assert str(err.value) == (
        f"1 rows are not leased under lease {m.lease_id} of task 'actor' (released earlier, or "
        f"never part of it)"
    )
    with pytest.raises(LeaseError, match="1 rows are not leased"):
        s.ack("p", "actor", m2.lease_id, [0, 1, 2])  # row 1 is not in m2


def test_ack_unknown_lease() -> None:
    s = new_state()
    put(s, 1)
    with pytest.raises(UnknownLeaseError) as err:
        s.ack("p", "actor", 777, [0])
    assert str(err.value) == (
        "lease 777 is unknown to this controller (never granted, or granted by a controller that "
        "has since restarted); get the rows again with get_meta"
    )
    with pytest.raises(UnknownLeaseError):
        s.release("p", "actor", 777, [0], 0.0)


def test_lease_expiry_makes_rows_available_and_late_ack_fails() -> None:
    s = new_state()
    put(s, 3)
    m = get(s, batch_size=2, now=0.0, lease_timeout=5.0)
    s.ack("p", "actor", m.lease_id, [m.row_ids[0]])
    assert s.expire(4.9) == Effects()
    s.expire(5.0)
    assert task_stats(s, "actor") == (2, 0, 1)
    with pytest.raises(LeaseExpiredError) as err:
        s.ack("p", "actor", m.lease_id, m.row_ids)
    assert str(err.value) == (
        f"lease {m.lease_id} of task 'actor' expired (lease_timeout) before this call: its 1 "
        f"unacked rows went back to available and may have been delivered to another reader; "
        f"ack sooner or pass a longer lease_timeout to get_meta"
    )
    with pytest.raises(LeaseExpiredError):
        s.release("p", "actor", m.lease_id, [m.row_ids[1]], 6.0)
    assert s.ack("p", "actor", m.lease_id, [m.row_ids[0]])[0] == 0  # the acked part: harmless
    again = get(s, batch_size=2, now=6.0)
    assert again.row_ids == [1, 2]  # the expired row is back, in its old place


def test_default_lease_timeout() -> None:
    s = new_state()
    put(s, 1)
    m = get(s, now=3.0)
    assert s.leases[m.lease_id].deadline == 3.0 + LEASE


# --- order ---
def test_oldest_ready_first_across_puts_and_put_fields() -> None:
    s = new_state()
    m0 = put(s, 2)  # rows 0, 1: 'a'
    m1 = put(s, 2, ("a", "b"))  # rows 2, 3: 'a', 'b'
    put_fields(s, [m0.row_ids[1]])  # row 1 gets 'b' last
    assert get(s, ("a",), 4, task="t1").row_ids == [0, 1, 2, 3]
    assert get(s, ("a", "b"), 3, task="t2").row_ids == [2, 3, 1]
    assert m1.row_ids == [2, 3]


def test_order_is_the_same_for_a_view_built_after_later_writes() -> None:
    """Order is by the moment a row became ready *for the requested fields*: writing another field
    later must not move the row back for a view created afterwards."""
    s = new_state()
    put(s, 1)  # row 0: 'a'
    put(s, 1)  # row 1: 'a'
    early = get(s, ("a",), 1, task="early")  # builds the ('early', a) view now
    s.release("p", "early", early.lease_id, early.row_ids, 0.0)
    put_fields(s, [0])  # row 0 gets 'b'
    assert get(s, ("a",), 2, task="early").row_ids == [0, 1]
    assert get(s, ("a",), 2, task="late").row_ids == [0, 1]


def test_released_row_keeps_its_place_in_a_view_created_while_it_was_leased() -> None:
    s = new_state()
    put(s, 2)  # rows 0, 1: 'a'
    m = get(s, ("a",), 1)  # row 0 leased
    put_fields(s, [0, 1])  # both get 'b' (row 0 first)
    put_fields(s, [0], ("c",))  # row 0 gets 'c'
    view_b = get(s, ("b",), 1, handle="x")  # built while row 0 is leased: row 1
    assert view_b.row_ids == [1]
    s.release("p", "actor", view_b.lease_id, view_b.row_ids, 0.0)
    s.release("p", "actor", m.lease_id, m.row_ids, 0.0)
    assert get(s, ("b",), 2).row_ids == [0, 1]  # row 0 became ready for 'b' first


# --- whole groups ---
def test_whole_groups_only_complete_groups_adjacent_exact_size() -> None:
    s = new_state()
    put(s, 2, groups=["g1", "g2"], group_size=2)  # rows 0 (g1), 1 (g2)
    assert get(s, ("a",), 4, whole_groups=True, handle="h") is None  # both incomplete
    plan = prepare(s, 2, groups=["g2", "g1"], group_size=2)  # rows 2 (g2), 3 (g1)
    _, effects = s.commit(plan.put_id, 0.0)
    # g2 was completed (by row 2) before g1 (by row 3): g2 first, members adjacent
    assert [(h, m.row_ids, m.groups) for h, m in effects.served] == [
        ("h", [1, 2, 0, 3], ["g2", "g2", "g1", "g1"])
    ]
    put(s, 3, groups=[None, "g3", None], group_size=2)  # rows 4, 5 (g3), 6
    m = get(s, ("a",), 2, whole_groups=True)
    assert m.row_ids == [4, 6]  # rows without a group are groups of one; g3 is incomplete


def test_whole_groups_with_a_small_group_first_still_serves_a_fitting_group() -> None:
    """Oldest first, exactly batch_size rows: a singleton that is older than a pair must not keep
    a batch of 2 from being served when a complete pair is ready."""
    s = new_state()
    put(s, 1, groups=[None])  # row 0: a group of one
    put(s, 2, groups=["g", "g"])  # rows 1, 2
    m = get(s, ("a",), 2, whole_groups=True, timeout=0.0)
    assert m.row_ids == [1, 2]


def test_whole_groups_takes_the_oldest_groups_that_make_exactly_the_batch() -> None:
    s = new_state()
    put(s, 3, groups=["A"] * 3)  # rows 0-2, oldest
    put(s, 2, groups=["B"] * 2)  # rows 3-4
    put(s, 1, groups=[None])  # row 5
    put(s, 2, groups=["C"] * 2)  # rows 6-7
    # 4 rows: A + row 5 (A is the oldest and can be completed), not B + C
    assert get(s, ("a",), 4, whole_groups=True, task="t1").row_ids == [0, 1, 2, 5]
    # 4 rows without A: B + C (row 5 would leave 3 rows, no group of 1 left)
    assert get(s, ("a",), 3, whole_groups=True, task="t2").row_ids == [0, 1, 2]
    assert get(s, ("a",), 4, whole_groups=True, task="t2").row_ids == [3, 4, 6, 7]
    assert get(s, ("a",), 5, whole_groups=True, task="t3").row_ids == [0, 1, 2, 3, 4]
    assert get(s, ("a",), 1, whole_groups=True, task="t2").row_ids == [5]
    with pytest.raises(RequestTimeoutError):
        get(s, ("a",), 1, whole_groups=True, task="t2", timeout=0.0)


def test_parked_whole_groups_request_is_served_even_if_an_earlier_one_takes_rows() -> None:
    """Serving parked requests in turn must not strand one that a single pass could serve."""
    s = new_state()
    put(s, 2, groups=["g1", "g1"], group_size=4)  # rows 0, 1: an incomplete group
    assert get(s, ("a",), 3, task="ref", whole_groups=True, handle="whole") is None
    assert get(s, ("a",), 3, task="ref", handle="plain") is None
    _, effects = s.commit(prepare(s, 4, groups=["g0", "g2", None, "g2"]).put_id, 0.0)
    served = dict(effects.served)
    assert sorted(served) == ["plain", "whole"]
    assert served["whole"].row_ids == [2, 3, 5]  # g0 (row 2) + g2 (rows 3, 5)
    assert served["plain"].row_ids == [0, 1, 4]


def test_whole_groups_oldest_group_first_after_release() -> None:
    """A group's place is the moment its last member became ready, also when a released member
    is what completes it in the view."""
    s = new_state()
    put(s, 1, groups=["g"], group_size=2)  # row 0
    put(s, 1, groups=[None])  # row 1: ready before g is complete
    put(s, 1, groups=["g"], group_size=2)  # row 2 completes g
    plain = get(s, ("a",), 1)  # leases row 0 (plain)
    assert get(s, ("a",), 1, whole_groups=True, task="other").row_ids == [1]
    assert get(s, ("a",), 3, whole_groups=True, handle="w") is None  # builds the view
    _, effects = s.release("p", "actor", plain.lease_id, plain.row_ids, 0.0)
    assert [(h, m.row_ids) for h, m in effects.served] == [("w", [1, 0, 2])]


def test_whole_groups_skips_groups_that_do_not_fit() -> None:
    s = new_state()
    put(s, 3, groups=["big", "big", "big"])  # rows 0-2
    put(s, 1)  # row 3: singleton
    m = get(s, ("a",), 1, whole_groups=True)
    assert m.row_ids == [3]
    m = get(s, ("a",), 3, whole_groups=True)
    assert m.row_ids == [0, 1, 2] and m.groups == ["big"] * 3


def test_group_with_a_leased_member_is_not_whole() -> None:
    s = new_state()
    put(s, 2, groups=["g", "g"])
    plain = get(s, ("a",), 1)  # leases row 0 as a plain row
    assert get(s, ("a",), 2, whole_groups=True, handle="w") is None
    _, effects = s.release("p", "actor", plain.lease_id, plain.row_ids, 0.0)
    assert [h for h, _ in effects.served] == ["w"]
    assert effects.served[0][1].row_ids == [0, 1]


def test_group_needs_every_member_ready_for_the_fields() -> None:
    s = new_state()
    m = put(s, 2, groups=["g", "g"])
    put_fields(s, m.row_ids[:1])
    assert get(s, ("a", "b"), 1, handle="one") is not None
    assert get(s, ("a", "b"), 2, whole_groups=True, task="t", handle="w") is None
    _, effects = put_fields(s, m.row_ids[1:])
    assert [(h, x.row_ids) for h, x in effects.served] == [("w", [0, 1])]


def test_group_over_several_puts() -> None:
    s = new_state()
    put(s, 1, groups=["g"], group_size=3)
    put(s, 1, groups=["g"], group_size=3)
    assert get(s, ("a",), 3, whole_groups=True, handle="w") is None
    _, effects = s.commit(prepare(s, 1, groups=["g"]).put_id, 0.0)  # no group_size: the group's
    assert effects.served[0][1].row_ids == [0, 1, 2]


def test_cleared_member_leaves_an_incomplete_group() -> None:
    s = new_state()
    put(s, 2, groups=["g", "g"])
    s.clear_samples("p", [0])
    assert get(s, ("a",), 2, whole_groups=True, handle="w") is None
    _, effects = s.commit(prepare(s, 1, groups=["g"]).put_id, 0.0)
    assert effects.served[0][1].row_ids == [1, 2]


# --- parking ---
def test_parked_request_served_by_commit_release_and_expiry() -> None:
    s = new_state()
    put(s, 1)
    m = get(s, batch_size=1, lease_timeout=5.0)
    assert get(s, batch_size=1, handle="h1") is None
    assert get(s, batch_size=2, handle="h2") is None
    assert s.stats("p")["p"].parked_requests == 2
    _, effects = s.release("p", "actor", m.lease_id, m.row_ids, 1.0)
    assert [(h, x.row_ids) for h, x in effects.served] == [("h1", [0])]
    _, effects = s.commit(prepare(s, 1).put_id, 2.0)
    assert effects.served == []  # h2 needs two available rows; row 0 is leased to h1
    lease_h1 = s.leases[max(s.leases)]
    assert lease_h1.deadline == 1.0 + LEASE
    effects = s.expire(1.0 + LEASE)
    assert [(h, x.row_ids) for h, x in effects.served] == [("h2", [0, 1])]
    assert s.stats("p")["p"].parked_requests == 0


def test_parked_request_times_out() -> None:
    s = new_state()
    put(s, 3, keys=["x", "y", "z"])
    m = get(s, batch_size=1)
    s.ack("p", "actor", m.lease_id, m.row_ids)
    get(s, batch_size=1)
    prepare(s, 1)
    assert get(s, ("a",), 4, handle="h", timeout=2.0, now=1.0, whole_groups=True) is None
    effects = s.expire(3.0)
    assert [h for h, _ in effects.failed] == ["h"]
    err = effects.failed[0][1]
    assert isinstance(err, RequestTimeoutError)
    assert str(err) == (
        "get_meta(partition='p', task='actor', fields=['a'], batch_size=4) timed out after 2.0s: "
        "1 of 4 rows ready; 1 rows still being put; 1 rows leased to 'actor' and not yet acked; "
        "1 rows already consumed by 'actor'; whole_groups: 1 complete groups ready (1 rows)"
    )
    assert s.stats("p")["p"].parked_requests == 0


def test_timeout_zero_raises_at_once() -> None:
    s = new_state()
    m = put(s, 2)
    put_fields(s, m.row_ids[:1])
    with pytest.raises(RequestTimeoutError) as err:
        get(s, ("a", "b"), 2, timeout=0.0)
    assert str(err.value).endswith(
        "timed out after 0.0s: 1 of 2 rows ready; field 'b' not written for 1 available rows"
    )
    assert s.stats("p")["p"].parked_requests == 0


def test_served_request_does_not_time_out_later() -> None:
    s = new_state()
    s.create_partition("p", ["a"])
    assert get(s, handle="h", timeout=2.0) is None
    _, effects = s.commit(prepare(s, 1).put_id, 1.0)
    assert [h for h, _ in effects.served] == ["h"]
    assert s.expire(5.0).failed == []


def test_parked_request_served_by_lease_expiring_before_its_timeout() -> None:
    """One expire() call past both deadlines: the lease expired (t=5) before the parked request's
    timeout (t=6), so the request must be served, as the service's timer would have done."""
    s = new_state()
    put(s, 1)
    get(s, task="t", lease_timeout=5.0, now=0.0)
    assert get(s, task="t", handle="h", timeout=6.0, now=0.0) is None
    effects = s.expire(7.0)
    assert [h for h, _ in effects.served] == ["h"]
    assert effects.failed == []


def test_cancel_parked() -> None:
    s = new_state()
    put(s, 1)
    assert get(s, batch_size=2, handle="h") is None
    s.cancel_parked("h")
    assert s.stats("p")["p"].parked_requests == 0
    _, effects = s.commit(prepare(s, 1).put_id, 0.0)
    assert effects.served == []


# --- clearing ---
def test_clear_samples_removes_rows_for_every_task() -> None:
    s = new_state()
    meta = put(s, 4, keys=list("wxyz"))
    a = get(s, batch_size=2, task="actor")  # rows 0, 1
    c = get(s, batch_size=1, task="critic")  # row 0
    s.ack("p", "critic", c.lease_id, c.row_ids)
    effects = s.clear_samples("p", [0, 2, 99])
    assert {u: d for u, d in effects.drop_rows.items()} == {meta.units[0]: {"p": [0, 2]}}
    assert s.list_keys("p") == ["x", "z"]
    assert s.stats("p")["p"].rows == 2
    assert task_stats(s, "actor") == (1, 1, 0)
    assert task_stats(s, "critic") == (2, 0, 0)
    assert s.ack("p", "actor", a.lease_id, a.row_ids)[0] == 1  # the cleared row is ignored
    assert s.ack("p", "critic", c.lease_id, c.row_ids)[0] == 0  # acked before, row cleared since
    assert sum(s.units.bytes) == 20
    s.clear_samples("p", [1, 3])
    assert s.units.bytes == [0, 0]
    with pytest.raises(UnknownKeyError):
        s.get_by_keys("p", ["w"], None)
    put(s, 1, keys=["w"])  # the key is free again


def test_clear_samples_ignores_pending_rows() -> None:
    s = new_state()
    plan = prepare(s, 2)
    effects = s.clear_samples("p", list(plan.rows()))
    assert not effects.drop_rows
    meta, _ = s.commit(plan.put_id, 0.0)
    assert meta is not None and s.stats("p")["p"].rows == 2


def test_clear_partition_fails_parked_and_cancels_puts() -> None:
    s = new_state()
    put(s, 2)
    plan = prepare(s, 1)
    fields_plan = put_fields(s, [0], commit=False)
    m = get(s, batch_size=1)
    assert get(s, batch_size=5, handle="h") is None
    effects = s.clear_partition("p")
    assert [n for n, _ in effects.drop_partitions] == ["p"]
    assert [h for h, _ in effects.failed] == ["h"]
    err = effects.failed[0][1]
    assert isinstance(err, PartitionClearedError)
    assert str(err) == "partition 'p' was cleared while this get_meta waited"
    assert s.units.bytes == [0, 0]
    assert "p" not in s.stats(None)
    meta, effects = s.commit(plan.put_id, 1.0)
    assert meta is None
    assert sorted(c for cs in effects.drop_chunks.values() for c in cs) == [
        seg.chunk for seg in plan.segments
    ]
    perr = s.put_error(plan.put_id)
    assert isinstance(perr, PartitionClearedError)
    assert str(perr) == (
        f"the partition of put {plan.put_id} was cleared while the put was in flight; nothing "
        f"was stored"
    )
    effects = s.expire(PUT + 1)  # put_fields of the cleared partition expires: chunks dropped
    assert sorted(c for cs in effects.drop_chunks.values() for c in cs) == [
        seg.chunk for seg in fields_plan.segments
    ]
    assert s.units.bytes == [0, 0]
    assert s.ack("p", "actor", m.lease_id, m.row_ids)[0] == 0  # lease ended 'cleared'
    effects = s.clear_partition("p")  # clearing again, like a second ack, is harmless
    assert effects == Effects() and "p" not in s.partitions


def test_cleared_partition_can_be_put_to_again() -> None:
    s = new_state()
    put(s, 2, keys=["x", "y"], groups=["g", "g"])
    m = get(s, batch_size=2, now=0.0)
    s.ack("p", "actor", m.lease_id, m.row_ids)
    s.clear_partition("p")
    put(s, 2, {"a": I64}, keys=["x", "y"], groups=["g", "g"])  # a new schema is fine
    # a fresh partition: nothing acked; row ids continue, so a late drop order of the old
    # incarnation can never hit the new rows at a storage unit
    assert get(s, batch_size=2).row_ids == [2, 3]
    # a double ack of the old lease stays harmless
    assert s.ack("p", "actor", m.lease_id, m.row_ids)[0] == 0


def test_put_fields_rolled_back_after_its_rows_were_cleared_keeps_bytes_exact() -> None:
    s = new_state(units=1)
    meta = put(s, 2)  # 20 bytes
    plan = put_fields(s, meta.row_ids, commit=False, nbytes=10)  # 5 bytes per row
    assert s.units.bytes == [30]
    s.clear_samples("p", meta.row_ids[:1])
    assert s.units.bytes == [15]
    s.abort(plan.put_id)
    assert s.units.bytes == [10]
    s.clear_samples("p", meta.row_ids[1:])
    assert s.units.bytes == [0]


def test_put_fields_expired_after_its_rows_were_cleared_keeps_bytes_exact() -> None:
    s = new_state(units=1)
    meta = put(s, 2)
    put_fields(s, meta.row_ids, commit=False, nbytes=10)
    s.clear_samples("p", meta.row_ids)
    assert s.units.bytes == [0]
    s.expire(PUT)
    assert s.units.bytes == [0]


def test_put_fields_committed_after_its_rows_were_cleared() -> None:
    s = new_state(units=1)
    meta = put(s, 2)
    plan = put_fields(s, meta.row_ids, commit=False, nbytes=10)
    s.clear_samples("p", meta.row_ids[:1])
    out, effects = s.commit(plan.put_id, 0.0)
    assert out is None
    assert effects.drop_rows == {0: {"p": [meta.row_ids[0]]}}
    assert s.stats("p")["p"].fields == {"a": 1, "b": 1}
    s.clear_samples("p", meta.row_ids)
    assert s.units.bytes == [0]


def test_stats_shape() -> None:
    s = new_state()
    put(s, 2, ("a", "b"))
    prepare(s, 1, ("a",))
    get(s, batch_size=1, task="actor")
    st = s.stats(None)["p"]
    assert st.rows == 2 and st.fields == {"a": 2, "b": 2} and st.pending_puts == 1
    assert st.schemas == {"a": F32, "b": F32}
    assert st.tasks["actor"].available == 1


def test_rejected_rows_count_once_when_a_put_is_aborted_and_retried() -> None:
    s = ControllerState()
    s.add_unit("u")
    req = PreparePut(rid=0, partition="p", n_rows=2, schemas={"a": F32}, nbytes=16, rejected=3)
    plan = s.prepare_put(req, 0.0)
    s.abort(plan.put_id)
    assert s.stats("p")["p"].rejected == 0  # nothing committed yet
    plan = s.prepare_put(req, 0.0)
    s.commit(plan.put_id, 0.0)
    assert s.stats("p")["p"].rejected == 3 and s.stats("p")["p"].produced == 2


# --- stored puts (the unit holds the data: PutRows) ---
def stored_req(n: int, nbytes: int = 8, partition: str = "p", **kw: Any) -> PreparePut:
    return PreparePut(rid=0, partition=partition, n_rows=n, schemas={"a": F32}, nbytes=nbytes, **kw)


def test_a_stored_put_lands_on_its_unit_committed_and_leaves_no_deadline() -> None:
    s = new_state(units=3)
    s.create_partition("p", ["a"])
    assert get(s, ("a",), 2, task="t", handle="reader") is None
    reply, effects = s.put_stored(stored_req(2, nbytes=16), 2, 0.0)
    assert reply is not None and reply.meta.units == [2, 2] and reply.meta.row_ids == [0, 1]
    assert s.units.bytes == [0, 0, 16] and not s.puts
    # no put_timeout to watch for a put committed in the same step (only the lease just given)
    assert [kind for _, kind, _ in s.deadlines.entries()] == ["lease"]
    ((handle, meta),) = effects.served  # the parked reader got the rows at once
    assert handle == "reader" and meta.row_ids == [0, 1]


def held(p: Partition) -> dict[int, tuple[object, ...]]:
    """Every row of ``p`` with its attributes."""
    return {
        rid: (p.key_of(r), r.unit, r.replica, r.nbytes, r.written, r.committed, r.version_start)
        for rid, r in p.rows.items()
    }


def test_a_refused_stored_put_changes_nothing() -> None:
    s = new_state()
    s.put_stored(stored_req(1, keys=["k"]), 0, 0.0)
    before = (held(s.partitions["p"]), list(s.units.bytes))
    with pytest.raises(DuplicateKeyError):
        s.put_stored(stored_req(1, keys=["k"]), 1, 0.0)
    with pytest.raises(InvalidRequestError, match="storage unit 5 is not registered"):
        s.put_stored(stored_req(1), 5, 0.0)
    assert (held(s.partitions["p"]), list(s.units.bytes)) == before


def test_a_stored_put_waits_for_room_on_its_own_unit() -> None:
    s = ControllerState(lease_timeout=LEASE, put_timeout=PUT)
    s.add_unit("u0", max_bytes=100)
    s.add_unit("u1", max_bytes=100)
    s.create_partition("p", ["a"], tasks=["t"])
    first, _ = s.put_stored(stored_req(1, nbytes=80), 0, 0.0)
    assert first is not None
    assert s.put_stored(stored_req(1, nbytes=80), 1, 0.0)[0] is not None
    # no unit has room for 40 more bytes: the put waits for room on the unit holding its data
    # (with room on another unit it would be refused, to be placed there: test_placement_locality)
    assert s.put_stored(stored_req(1, nbytes=40, timeout=5.0), 0, 1.0, "producer")[0] is None
    assert s.puts.parked("producer").pinned == 0
    meta = get(s, ("a",), 1, task="t", now=2.0)
    assert meta is not None and meta.units == [0]
    _, effects = s.ack("p", "t", meta.lease_id, meta.row_ids)  # frees unit 0's 80 bytes
    ((handle, reply),) = effects.replies
    assert handle == "producer" and reply.meta.units == [0] and s.units.bytes == [40, 80]
    with pytest.raises(CapacityError, match="can never fit on storage unit 1, whose quota is 100"):
        s.put_stored(stored_req(1, nbytes=150), 1, 3.0)


def test_equally_loaded_units_take_puts_in_turn() -> None:
    # consumers keep up: every unit holds 0 bytes at each put, and the puts still spread
    s = new_state(units=3)
    units = []
    for _ in range(6):
        s.units.bytes[:] = [0, 0, 0]  # as if the previous puts were acked and freed at once
        [segment] = prepare(s, 2).segments
        units.append(segment.unit)
    assert units == [0, 1, 2, 0, 1, 2]
    s.units.bytes[:] = [0, 5, 0]  # the least loaded still come first: ties only rotate
    assert [seg.unit for seg in prepare(s, 2).segments] in ([0], [2])


def test_ended_leases_and_puts_leave_the_deadline_heap() -> None:
    from tqstream.controller.records import COMPACT_MIN

    s = new_state()
    for i in range(4 * COMPACT_MIN):  # every put committed and every lease acked at once
        now = float(i)
        put(s, 1, now=now)
        req = GetMeta(rid=0, partition="p", task="t", fields=["a"], batch_size=1)
        got, _ = s.get_meta(req, next(_handles), now)
        assert got is not None and got.lease_id is not None
        assert s.ack("p", "t", got.lease_id, got.row_ids)[0] == 1
    assert sum(1 for e in s.deadlines.entries() if s._live(*e)) == 0
    assert len(s.deadlines) < 2 * COMPACT_MIN  # not 8 * COMPACT_MIN: ended entries were swept


# --- writes by key, tags, consumption resets ---
def keyed(
    s: ControllerState,
    keys: list[str],
    fields: Any = ("b",),
    commit: bool = True,
    **kw: Any,
) -> Any:
    schemas = fields if isinstance(fields, dict) else {f: F32 for f in fields}
    req = PrepareFields(
        rid=0, partition="p", row_ids=[], schemas=schemas, nbytes=5 * len(keys), keys=keys, **kw
    )
    plan = s.prepare_fields(req, 0.0)
    return s.commit(plan.put_id, 0.0) if commit else plan


def test_a_keyed_write_creates_rows_at_its_commit_and_merges_tags() -> None:
    s = new_state(units=1)
    s.upsert_rows("p", ["x"], [{"status": "pending", "n": 1}], True)
    plan = keyed(s, ["x", "y"], create=True, tags=[{"status": "done"}, {"k": [1, 2]}], commit=False)
    assert s.list_keys("p") == ["x"]  # y is created by the commit, not before
    meta, _ = s.commit(plan.put_id, 0.0)
    assert meta.keys == ["x", "y"] and meta.fields == ["b"]
    assert meta.tags == [{"status": "done", "n": 1}, {"k": [1, 2]}]
    st = s.stats("p")["p"]
    assert st.rows == 2 and st.produced == 2 and st.fields == {"b": 2}
    assert get(s, ("b",), batch_size=2).keys == ["x", "y"]


def test_an_aborted_keyed_write_removes_the_rows_it_created_and_their_bytes() -> None:
    s = new_state(units=1)
    keyed(s, ["x"], create=True)
    held = s.units.bytes[0]
    plan = keyed(s, ["x", "y", "z"], fields=("c",), create=True, tags=[{"t": 1}] * 3, commit=False)
    s.abort(plan.put_id)
    assert s.list_keys("p") == ["x"] and s.units.bytes == [held]
    assert s.get_by_keys("p", ["x"], None).tags == []  # the aborted write's tags are not kept
    assert s.stats("p")["p"].produced == 1


def test_overwrite_replaces_written_fields_without_counting_them_twice() -> None:
    s = new_state(units=1)
    keyed(s, ["x", "y"], create=True)
    with pytest.raises(FieldExistsError, match="pass overwrite=True"):
        keyed(s, ["x"])
    keyed(s, ["x", "y"], overwrite=True)
    assert s.stats("p")["p"].fields == {"b": 2}
    busy = keyed(s, ["x"], fields=("c",), commit=False)
    with pytest.raises(FieldExistsError, match="being written by another put_fields"):
        keyed(s, ["x"], fields=("c",), overwrite=True)
    s.abort(busy.put_id)
    with pytest.raises(UnknownKeyError, match="'q'"):
        keyed(s, ["x", "q"], overwrite=True)


def test_upsert_rows_creates_rows_without_fields_placed_on_a_unit() -> None:
    s = new_state(units=2)
    meta = s.upsert_rows("p", ["a", "b"], [{"is_prompt": True}, None], True)
    assert meta.fields == [] and meta.tags == [{"is_prompt": True}, {}]
    assert all(u in (0, 1) for u in meta.units)
    with pytest.raises(UnknownKeyError):
        s.upsert_rows("p", ["a", "nope"], None, False)
    with pytest.raises(UnknownPartitionError):
        s.upsert_rows("other", ["a"], None, False)
    again = s.upsert_rows("p", ["b"], [{"status": "x"}], False)
    assert again.tags == [{"status": "x"}] and s.stats("p")["p"].rows == 2
    with pytest.raises(InvalidRequestError, match="named more than once"):
        s.upsert_rows("p", ["a", "a"], None, True)
    # rows without fields never serve a get; their fields, written later, do
    with pytest.raises(UnknownFieldError):
        get(s, ("b",), timeout=0)
    keyed(s, ["a", "b"])
    assert sorted(get(s, ("b",), batch_size=2).keys) == ["a", "b"]


def test_reset_consumption_ends_leases_and_rebuilds_the_views() -> None:
    s = new_state()
    put(s, 3)
    leased = get(s, batch_size=1)
    acked = get(s, batch_size=1)
    s.ack("p", "actor", acked.lease_id, acked.row_ids)
    assert s.reset_consumption("p", "actor", 0.0)[0] == 2
    assert s.ack("p", "actor", leased.lease_id, leased.row_ids)[0] == 0  # ended: harmless
    assert sorted(get(s, batch_size=3).row_ids) == [0, 1, 2]
    assert s.reset_consumption("p", None, 0.0)[0] == 3
    assert s.reset_consumption("p", "never-read", 0.0)[0] == 0
    with pytest.raises(UnknownPartitionError):
        s.reset_consumption("nope", None, 0.0)


def test_max_rows_counts_rows_being_put() -> None:
    s = ControllerState(max_rows=3)
    s.add_unit("tcp://unit0")
    prepare(s, 2)
    with pytest.raises(CapacityError, match=r"holds 2 rows and max_rows=3: 2 more"):
        prepare(s, 2)
    with pytest.raises(CapacityError):
        s.upsert_rows("q", ["a", "b"], None, True)
    s.upsert_rows("q", ["a"], None, True)
