"""The controller's put book: a put starts by open and ends by end, recorded once; puts waiting
for room are parked and unparked in arrival order."""

from __future__ import annotations

import pytest

from tqstream.controller.book import PendingPut, PutBook, WaitingPut
from tqstream.protocol.messages import PreparePut


def pending(put_id: int, partition: str = "p", owner: object = None, unit: int = 0) -> PendingPut:
    return PendingPut(put_id, partition, [], 1, [f"f{put_id}"], [(unit, 100 + put_id)], True, 8,
                      owner=owner)  # fmt: skip


def test_a_put_is_in_flight_until_it_ends_then_its_end_answers() -> None:
    book = PutBook()
    a, b = pending(1), pending(2, owner="peer", unit=1)
    book.open(a)
    book.open(b)
    assert dict(book) == {1: a, 2: b} and book.status(1) == "pending"
    assert book.where(owner="peer") == [b] and book.where(unit=1, partition="p") == [b]
    assert book.end(1, "committed") is a
    assert book.end(1, "aborted") is None  # a second end changes nothing
    assert 1 not in book and book.status(1) == "committed" and book.status(9) is None
    with pytest.raises(ValueError, match="was used before"):
        book.open(pending(1))


def test_fields_in_flight_leave_out_puts_of_a_cleared_partition() -> None:
    book = PutBook()
    for x in (pending(1), pending(2), pending(3, partition="q")):
        book.open(x)
    book[2].cancelled = True
    assert book.fields_in_flight("p") == {"f1"} and book.fields_in_flight("q") == {"f3"}
    assert book.where(partition="p", live=True) == [book[1]]


def test_waiting_puts_come_back_in_arrival_order_and_once() -> None:
    book = PutBook()
    reqs = [PreparePut(rid=0, partition="p", n_rows=1, schemas={}, nbytes=8 * i) for i in range(3)]
    for i, req in enumerate(reqs):
        book.park(f"h{i}", WaitingPut(req, float(i), None if i else 0))
    assert [h for h, _ in book.waiting()] == ["h0", "h1", "h2"]
    assert book.parked("h0") == WaitingPut(reqs[0], 0.0, 0)
    assert book.unpark("h1") == WaitingPut(reqs[1], 1.0, None)
    assert book.unpark("h1") is None and book.parked("h1") is None
    assert [h for h, _ in book.waiting()] == ["h0", "h2"]
