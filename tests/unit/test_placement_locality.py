"""Locality at the controller and in the client's reads: rows go to the writer's host first."""

from __future__ import annotations

import pytest

from tqstream.client.core import read_near
from tqstream.config import ClientConfig
from tqstream.controller.state import ControllerState
from tqstream.controller.units import UnitTable
from tqstream.errors import ConfigError, PlacementRequiredError
from tqstream.protocol.messages import PreparePut
from tqstream.types import BatchMeta, FieldSchema

X = FieldSchema("dense", "float32", (4,))


def table(*quotas: int) -> UnitTable:
    units = UnitTable()
    for i, quota in enumerate(quotas):
        units.add(f"tcp://u{i}", quota)
    return units


def test_rows_go_to_the_writers_host_while_it_has_room() -> None:
    units = table(0, 100, 0)
    for _ in range(2):  # round-robin would spread these; the writer's unit takes them all
        assert units.place(4, 40, near=[1]) == [(1, -1, 0, 4)]
        units.charge(1, -1, 40)
    # no room left there for 40 more bytes: the least loaded of all takes the put
    runs = units.place(4, 40, near=[1])
    assert runs is not None and len(runs) == 1 and runs[0][0] in (0, 2)


def test_a_second_copy_goes_to_another_unit_and_near_units_that_are_lost_are_skipped() -> None:
    units = table(0, 0, 0)
    runs = units.place(4, 40, replicas=2, near=[2])
    assert runs is not None and [(u, start, stop) for u, _, start, stop in runs] == [(2, 0, 4)]
    assert runs[0][1] in (0, 1)
    units.lose(2)
    runs = units.place(4, 40, near=[2])
    assert runs is not None and runs[0][0] in (0, 1)


def test_every_unit_near_is_plain_placement() -> None:
    a, b = table(0, 0), table(0, 0)
    assert a.place(4, 40, near=[0, 1]) == b.place(4, 40)


def test_a_direct_put_to_a_full_unit_is_placed_elsewhere_not_kept_waiting() -> None:
    s = ControllerState(lease_timeout=10, put_timeout=10)
    s.add_unit("tcp://u0", max_bytes=100)
    s.add_unit("tcp://u1", max_bytes=100)
    req = PreparePut(rid=0, partition="p", n_rows=1, schemas={"x": X}, nbytes=80)
    stored, _ = s.put_stored(req, 0, 0.0, handle="h1")
    assert stored is not None
    before = (list(s.units.bytes), s.stats("p")["p"].rows)
    with pytest.raises(PlacementRequiredError) as err:
        s.put_stored(req, 0, 0.0, handle="h2")  # unit 0 is full, unit 1 has room
    assert err.value.details["full"] is True and "has no room" in str(err.value)
    assert (list(s.units.bytes), s.stats("p")["p"].rows) == before  # nothing changed
    s.put_stored(req, 1, 0.0, handle="h3")
    # no unit has room: the put waits for room on its unit, as before
    stored, _ = s.put_stored(req, 0, 0.0, handle="h4")
    assert stored is None and s.puts.parked("h4") is not None


def meta(units: list[int], replicas: list[int]) -> BatchMeta:
    n = len(units)
    return BatchMeta(
        "p", list(range(n)), [str(i) for i in range(n)], units, [None] * n, [None] * n,
        [None] * n, ["x"], {}, replicas=replicas,
    )  # fmt: skip


def test_reads_of_two_copies_take_the_one_on_this_host() -> None:
    m = meta([0, 1, 0, 2], [1, 0, 2, 0])
    near = read_near(m, {1})
    assert near.units == [1, 1, 0, 2] and near.replicas == [0, 0, 2, 0]  # row 0 read from 1
    assert read_near(m, {0}).units == [0, 0, 0, 0]
    assert read_near(m, {3}) is m  # no row has a copy on this host
    assert near.row_ids == m.row_ids and near.keys == m.keys


def test_locality_setting_is_checked() -> None:
    assert ClientConfig().locality == "host" and ClientConfig(locality="off").locality == "off"
    with pytest.raises(ConfigError, match=r"locality must be one of 'host', 'off', got 'near'"):
        ClientConfig(locality="near")
    with pytest.raises(ConfigError, match=r"shared_memory must be one of 'auto', 'off'"):
        ClientConfig(shared_memory="on")
