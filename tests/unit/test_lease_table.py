"""The controller's lease table: a lease starts by grant and ends by end, recorded once."""

from __future__ import annotations

import pytest

from tqstream.controller.leases import Lease, LeaseTable


def lease(lease_id: int, partition: str = "p", task: str = "t", owner: object = None) -> Lease:
    return Lease(lease_id, partition, task, {10 * lease_id, 10 * lease_id + 1}, 5.0, owner=owner)


def test_a_lease_is_active_until_it_ends_then_its_end_answers() -> None:
    table = LeaseTable()
    a, b = lease(1), lease(2, task="u", owner="peer")
    table.grant(a)
    table.grant(b)
    assert dict(table) == {1: a, 2: b} and table.status(1) == "active"
    assert table.where(task="u") == [b] and table.where(owner="peer", partition="p") == [b]
    table.end(a, "acked")
    table.end(a, "expired")  # a second end changes nothing
    assert 1 not in table and table.status(1) == "acked" and table.status(9) is None
    with pytest.raises(ValueError, match="id 1 was used before"):
        table.grant(lease(1))


def test_deleted_rows_leave_their_leases_and_an_emptied_lease_ends_cleared() -> None:
    table = LeaseTable()
    a, b, c = lease(1), lease(2), lease(3, partition="q")
    for x in (a, b, c):
        table.grant(x)
    table.forget_rows("p", {10, 11, 20, 30, 31})
    assert table.status(1) == "cleared" and b.rows == {21} and c.rows == {30, 31}
    assert list(table) == [2, 3]
