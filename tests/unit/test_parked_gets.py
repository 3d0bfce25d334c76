"""The controller's parked gets: by partition in arrival order, each leaving once."""

from __future__ import annotations

import pytest

from tqstream.controller.parked import Parked, ParkedGets
from tqstream.protocol.messages import GetMeta


def parked(handle: object, partition: str = "p") -> Parked:
    req = GetMeta(rid=0, partition=partition, fields=["x"], batch_size=1, task="t")
    return Parked(handle, req, 1)


def test_a_parked_get_leaves_once_by_whichever_way_comes_first() -> None:
    gets = ParkedGets()
    a, b, c = parked("h1"), parked("h2"), parked("h3", partition="q")
    for x in (a, b, c):
        gets.park(x)
    assert gets.of("p") == [a, b] and gets.count("q") == 1 and len(gets) == 3
    assert gets.unpark(a) and not gets.unpark(a) and not gets.holds(a)
    gets.cancel("h2")
    assert gets.of("p") == [] and gets.drop_partition("q") == [c] and len(gets) == 0


def test_a_handle_parks_one_get_at_a_time() -> None:
    gets = ParkedGets()
    first = parked("h1")
    gets.park(first)
    with pytest.raises(ValueError, match="a request handle parks one get at a time"):
        gets.park(parked("h1", partition="q"))
    assert gets.of("p") == [first] and gets.count("q") == 0 and len(gets) == 1


class Handle:
    def __init__(self, peer: bytes) -> None:
        self.peer = peer


def test_a_gone_peer_s_gets_leave_and_others_stay() -> None:
    gets = ParkedGets()
    mine, other = parked(Handle(b"peer")), parked(Handle(b"other"))
    gets.park(mine)
    gets.park(other)
    gets.drop_peer(b"peer")
    assert gets.of("p") == [other]
