"""The controller's admission table: admissions by name, acquires waiting for a slot in arrival
order, and which peer holds each granted slot."""

from __future__ import annotations

import pytest

from tqstream.controller.admission import make_admission
from tqstream.controller.flow import AdmissionRecord, AdmissionTable, WaitingAcquire
from tqstream.errors import AdmissionError
from tqstream.protocol.messages import Acquire


def test_an_admission_is_found_by_name_and_a_missing_one_says_how_to_create_it() -> None:
    table = AdmissionTable()
    adm = make_admission("capacity", max_concurrent=2, consumer_batch_size=4, max_staleness=1)
    table.install("a", AdmissionRecord(adm, "capacity", {"max_concurrent": 2}))
    assert table.admission("a") is adm and list(table) == ["a"] and table["a"].style == "capacity"
    assert table.states() == {"a": adm.state()}
    with pytest.raises(AdmissionError, match=r"create it first with client.admission"):
        table.admission("b")


def test_waiting_acquires_come_back_by_admission_in_arrival_order() -> None:
    table = AdmissionTable()
    reqs = [Acquire(rid=0, name=n, n=1, version=0) for n in ("a", "b", "a")]
    for i, req in enumerate(reqs):
        table.park(f"h{i}", WaitingAcquire(req, float(i)))
    assert [h for h, _ in table.waiting("a")] == ["h0", "h2"]
    assert table.unpark("h0") == WaitingAcquire(reqs[0], 0.0) and table.unpark("h0") is None
    assert table.parked("h2") == WaitingAcquire(reqs[2], 2.0)
    assert [h for h, _ in table.waiting()] == ["h1", "h2"]


def test_a_peer_s_slots_are_taken_back_once_and_released_or_voided_ones_are_not() -> None:
    table = AdmissionTable()
    table.own("a", [1, 2, 3], "p1")
    table.own("a", [4], "p2")
    table.own("b", [1], "p1")
    table.own("b", [2], None)  # nobody to watch: not recorded
    table.disown("a", [2])
    table.void("b")
    assert table.take_peer("p1") == {"a": [1, 3]}
    assert table.take_peer("p1") == {} and table.take_peer("p2") == {"a": [4]}
