"""The controller's pure state under faults: a lost unit, a revived one, replicas, a peer that
went away (``tqstream.controller.faults``, ``units``). No sockets: handles carry a ``peer``."""

from __future__ import annotations

import dataclasses

import pytest
from test_controller_state import F32, get, new_state, prepare, put

from tqstream.controller.units import UnitTable
from tqstream.errors import (
    CapacityError,
    ConfigError,
    InvalidRequestError,
    LeaseExpiredError,
    PlacementRequiredError,
    UnitLostError,
)
from tqstream.launch.processes import ProcessCluster
from tqstream.protocol.messages import Acquire, PreparePut


@dataclasses.dataclass(eq=False)
class Handle:
    """What the service passes as a request handle: the requester's connection is ``peer``."""

    peer: bytes


def test_placement_skips_lost_units_and_takes_them_back_when_revived() -> None:
    t = UnitTable()
    for u in range(3):
        t.add(f"tcp://u{u}")
    assert t.lose(1) and not t.lose(1)
    placed = [t.place(1, 10)[0][0] for _ in range(6)]  # type: ignore[index]
    assert set(placed) == {0, 2}
    t.revive(1)
    assert {t.place(1, 10)[0][0] for _ in range(6)} == {0, 1, 2}  # type: ignore[index]
    t.lose(0), t.lose(1), t.lose(2)
    with pytest.raises(CapacityError, match="all 3 storage units are lost"):
        t.place(1, 10)


def test_replicas_go_to_another_unit_and_degrade_to_one_copy_with_one_unit() -> None:
    t = UnitTable()
    for u in range(3):
        t.add(f"tcp://u{u}")
    for _ in range(6):
        [(unit, replica, _, _)] = t.place(4, 40, replicas=2)  # type: ignore[misc]
        assert replica >= 0 and replica != unit
    t.lose(0), t.lose(1)
    assert t.place(4, 40, replicas=2) == [(2, -1, 0, 4)]


def test_a_lost_unit_loses_its_rows_for_every_task_that_had_not_acked_them() -> None:
    s = new_state(2)
    metas = [put(s, 2) for _ in range(4)]  # placement alternates: 4 rows on each unit
    assert sorted(u for m in metas for u in m.units) == [0] * 4 + [1] * 4
    on_1 = [r for m in metas for r, u in zip(m.row_ids, m.units, strict=True) if u == 1]
    first = get(s, ["a"], 8, "t")
    s.ack("p", "t", first.lease_id, [r for r in first.row_ids if r not in on_1[:2]])
    s.lose_unit(1, 0.0)
    p = s.stats("p")["p"]
    assert (p.rows, p.lost, p.tasks["t"].lost) == (4, 4, 2)  # t had acked 2 of the 4
    assert s.units.bytes == [40, 0] and not s.units.alive[1]
    assert all(r.unit == 0 for r in s.partitions["p"].rows.values())
    assert put(s, 2).units == [0, 0]  # no placement on the lost unit


def test_replicated_rows_survive_a_lost_unit_and_are_served_from_the_copy() -> None:
    s = new_state(3)
    s.create_partition("p", ["a"], replicas=2)
    meta = put(s, 4)
    assert len(meta.replicas) == 4
    victim, copy = meta.units[0], meta.replicas[0]
    s.lose_unit(victim, 0.0)
    served = get(s, ["a"], 4, "t")
    assert served.units == [copy] * 4 and served.replicas == []  # one copy left, on ``copy``
    assert s.stats("p")["p"].lost == 0
    s.ack("p", "t", served.lease_id, served.row_ids)
    s.clear_partition("p")
    assert s.units.bytes == [0, 0, 0]


def test_a_put_in_flight_on_a_lost_unit_is_rolled_back_with_a_unit_lost_error() -> None:
    s = new_state(1)
    plan = prepare(s, 2)
    s.lose_unit(0, 0.0)  # (its drop orders to the lost unit are skipped by the service)
    with pytest.raises(UnitLostError, match="a storage unit it was stored on was lost"):
        s.commit(plan.put_id, 0.0)


def test_a_revived_unit_is_told_to_drop_what_it_held() -> None:
    s = new_state(2)
    put(s, 2)
    s.lose_unit(0, 0.0)
    revived, effects = s.add_unit("tcp://unit0")
    assert revived == 0 and s.units.alive[0]
    [(unit, before)] = effects.reset_units
    assert unit == 0 and before > 0


def test_a_direct_put_to_a_replicated_partition_must_be_placed() -> None:
    s = new_state(2)
    s.create_partition("p", ["a"], replicas=2)
    req = PreparePut(rid=0, partition="p", n_rows=1, schemas={"a": F32}, nbytes=10)
    with pytest.raises(PlacementRequiredError):
        s.put_stored(req, 0, 0.0)
    s.lose_unit(1, 0.0)  # one unit left: one copy is all there can be, stored directly
    assert s.put_stored(req, 0, 0.0)[0] is not None


def test_a_gone_peer_gives_back_leases_parked_gets_puts_and_slots() -> None:
    s = new_state(1)
    dead, live = Handle(b"dead"), Handle(b"live")
    put(s, 2)
    leased = get(s, ["a"], 2, "t", handle=dead)
    assert get(s, ["a"], 1, "t", handle=Handle(b"dead"), timeout=None) is None  # parked
    plan = prepare(s, 3)
    s.puts[plan.put_id].owner = b"dead"
    s.create_admission("adm", "slots", {"max_pending_slots": 2, "max_version_slots": 9})
    acquire = Acquire(rid=0, name="adm", n=2, version=0)
    assert s.acquire(acquire, 0.0, dead) == [1, 2]
    assert s.acquire(acquire, 0.0, live) is None  # parked: both slots are taken
    effects = s.drop_peer(b"dead", 0.0)
    [(handle, slots)] = effects.replies  # the live parked acquire got the slots
    assert handle is live and len(slots.slot_ids) == 2
    assert len(s.parked) == 0
    assert plan.put_id not in s.puts and effects.drop_chunks  # rolled back
    assert s.stats("p")["p"].tasks["t"].available == 2
    with pytest.raises(LeaseExpiredError, match="connection that took it dropped"):
        s.ack("p", "t", leased.lease_id, leased.row_ids[:1])
    assert s.admission_stats()["adm"]["rejected"] == 2


def test_a_stored_put_from_a_lost_unit_is_refused() -> None:
    s = new_state(2)
    s.lose_unit(0, 0.0)
    req = PreparePut(rid=0, partition="p", n_rows=1, schemas={"a": F32}, nbytes=10)
    with pytest.raises(UnitLostError, match=r"storage unit 0 at tcp://unit0 was declared lost"):
        s.put_stored(req, 0, 0.0)
    assert "p" not in s.partitions


def test_replicas_out_of_range_are_refused_by_the_state_and_the_launcher() -> None:
    with pytest.raises(InvalidRequestError, match="replicas must be 1 or 2, got 3"):
        new_state(1).create_partition("p", ["a"], replicas=3)
    with pytest.raises(ConfigError, match=r"replicas must be 1 or 2, got 0 \(tqstream-launch"):
        ProcessCluster(1, replicas=0)
