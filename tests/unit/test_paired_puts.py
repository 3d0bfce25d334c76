"""A put of two copies in one exchange (``PreparePut.pair``): each copy's unit has the controller
commit it, which it does once both are in; refusals, a lost unit and a copy that never comes fail
both (or the one that waits) and change nothing."""

from __future__ import annotations

from typing import Any

import pytest
from test_controller_state import F32, new_state

from tqstream.errors import (
    DuplicateKeyError,
    InvalidRequestError,
    PlacementRequiredError,
    RequestTimeoutError,
    UnitLostError,
)
from tqstream.protocol.messages import Pair, PreparePut, StoredReply

PUT = 10.0  # new_state's put_timeout


def copy(token: int = 7, units: tuple[int, int] = (0, 1), **kw: Any) -> PreparePut:
    return PreparePut(rid=0, partition="p", n_rows=3, schemas={"a": F32}, nbytes=30,
                      pair=Pair(token, list(units)), **kw)  # fmt: skip


def state(units: int = 2, **kw: Any) -> Any:
    s = new_state(units)
    s.create_partition("p", ["a"], tasks=["t"], replicas=2, **kw)
    return s


def unchanged(s: Any) -> None:
    """Nothing stored: no row, no put in flight, no byte on a unit, no copy waiting."""
    p = s.partitions["p"]
    assert p.committed == 0 and len(p.rows) == 0 and not s.puts
    assert s.units.bytes == [0] * len(s.units.bytes)
    assert not s.puts.halves_with(0) and not s.puts.halves_with(1)


def test_the_second_copy_commits_the_rows_once_for_both_units():
    s = state()
    reply, handles, effects = s.put_paired(copy(), 1, 0.0, "unit 1's")
    assert reply is None and handles == [] and not effects.failed  # waits for the other copy
    assert s.partitions["p"].committed == 0
    reply, handles, effects = s.put_paired(copy(), 0, 0.0, "unit 0's")
    assert isinstance(reply, StoredReply) and handles == ["unit 1's", "unit 0's"]
    meta = reply.meta
    assert meta is not None and meta.units == [0, 0, 0] and meta.replicas == [1, 1, 1]
    assert s.partitions["p"].committed == 3 and s.units.bytes == [30, 30]
    assert not s.puts.halves_with(0)  # nothing left waiting
    s.expire(PUT + 1)  # the pair's deadline is stale now: nothing happens
    assert s.partitions["p"].committed == 3


def test_a_copy_whose_partner_never_comes_fails_at_put_timeout():
    s = state()
    s.put_paired(copy(), 0, 0.0, "waiting")
    assert not s.expire(PUT - 1).failed
    [(handle, exc)] = s.expire(PUT + 0.1).failed
    assert handle == "waiting" and isinstance(exc, RequestTimeoutError)
    assert "did not reach the controller" in str(exc)
    unchanged(s)
    # the late copy waits on its own (and fails the same way): no row from half a pair
    assert s.put_paired(copy(), 1, PUT + 0.2, "late")[0] is None
    assert s.expire(2 * PUT + 1).failed[0][0] == "late"
    unchanged(s)


@pytest.mark.parametrize("lost", [0, 1])
def test_a_lost_unit_of_the_pair_fails_the_waiting_copy(lost):
    s = state(units=3)
    s.put_paired(copy(), 0, 0.0, "waiting")
    effects = s.lose_unit(lost, 0.0)
    [(handle, exc)] = effects.failed
    assert handle == "waiting" and isinstance(exc, UnitLostError)
    assert f"storage unit {lost} (tcp://unit{lost}), one of the two units" in str(exc)
    assert "nothing was stored: put again" in str(exc)
    unchanged(s)


def test_a_lost_unit_outside_the_pair_changes_nothing_for_it():
    s = state(units=3)
    s.put_paired(copy(), 0, 0.0, "waiting")
    assert not s.lose_unit(2, 0.0).failed
    assert s.put_paired(copy(), 1, 0.0, "second")[0] is not None


def test_refused_rows_fail_both_copies_and_store_nothing():
    s = state()
    s.put_paired(copy(1, keys=["a", "b", "c"]), 0, 0.0, "a0")
    s.put_paired(copy(1, keys=["a", "b", "c"]), 1, 0.0, "a1")
    before = s.partitions["p"].committed, list(s.units.bytes)
    s.put_paired(copy(2, keys=["c", "d", "e"]), 0, 0.0, "b0")
    reply, handles, effects = s.put_paired(copy(2, keys=["c", "d", "e"]), 1, 0.0, "b1")
    assert reply is None and handles == []
    assert [h for h, _ in effects.failed] == ["b0", "b1"]
    assert all(isinstance(e, DuplicateKeyError) for _, e in effects.failed)
    assert (s.partitions["p"].committed, s.units.bytes) == before


def test_copies_that_differ_or_come_from_one_unit_are_refused():
    s = state()
    s.put_paired(copy(), 0, 0.0, "first")
    _, _, effects = s.put_paired(copy(version=3), 1, 0.0, "other rows")
    assert [h for h, _ in effects.failed] == ["first", "other rows"]
    assert all(isinstance(e, InvalidRequestError) for _, e in effects.failed)
    assert "the two copies of a replicated put (pair 7) differ" in str(effects.failed[0][1])
    s.put_paired(copy(9), 0, 0.0, "first")
    _, _, effects = s.put_paired(copy(9), 0, 0.0, "again from 0")
    assert len(effects.failed) == 2
    unchanged(s)
    with pytest.raises(InvalidRequestError, match="two different units"):
        s.put_paired(copy(units=(1, 1)), 1, 0.0, "x")
    with pytest.raises(InvalidRequestError, match="reached unit 2"):
        state(units=3).put_paired(copy(), 2, 0.0, "x")


def test_no_room_on_a_unit_of_the_pair_has_both_copies_placed_instead():
    s = new_state(2)
    s.units.quota[1] = 40
    s.create_partition("p", ["a"], replicas=2)
    s.put_paired(copy(1), 0, 0.0, "a")
    s.put_paired(copy(1), 1, 0.0, "b")  # 30 of unit 1's 40 bytes
    s.put_paired(copy(2), 0, 0.0, "c")
    _, _, effects = s.put_paired(copy(2), 1, 0.0, "d")
    assert [h for h, _ in effects.failed] == ["c", "d"]
    exc = effects.failed[0][1]
    assert isinstance(exc, PlacementRequiredError) and exc.details["full"]
    assert str(exc).startswith("unit 0 or 1 has no room for this put's 30 bytes (its quota)")
    assert s.units.bytes == [30, 30]


def test_a_copy_naming_a_lost_unit_is_refused_at_once():
    s = state(units=3)
    s.lose_unit(1, 0.0)
    with pytest.raises(UnitLostError, match="unit 1"):  # unit 1's copy cannot come any more
        s.put_paired(copy(), 0, 0.0, "first")
    unchanged(s)


def test_a_pair_for_a_partition_of_one_copy_is_refused_so_the_client_puts_once():
    s = new_state(2)
    s.create_partition("p", ["a"])  # re-created with one copy since the client learnt two
    with pytest.raises(PlacementRequiredError, match="keeps one copy of each row") as err:
        s.put_paired(copy(), 0, 0.0, "x")
    assert err.value.details["replicas"] == 1
    assert s.partitions["p"].committed == 0 and not s.puts.halves_with(0)
