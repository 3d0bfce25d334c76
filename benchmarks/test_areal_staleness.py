"""areal-staleness: what AReaL's rollout bookkeeping costs its caller, per callback and per rollout,
with AReaL's own ``StalenessManager`` and with tqstream's (its budget at the controller).

Cases (one round each, timed on the caller's thread):

- ``enqueued`` / ``submitted`` / ``accepted`` / ``rejected``: one ``on_rollout_*`` callback, made
  when the manager is quiet (the report of the previous one has gone out: the untimed setup waits
  for it), so each round pays for scheduling its own report — the cost of an isolated callback,
  not of a burst, whose callbacks share one report;
- ``rollout``: ``get_capacity()`` + ``on_rollout_submitted()`` + ``on_rollout_accepted()``, what
  AReaL's executor calls per rollout (``on_rollout_enqueued`` in the setup): tqstream's
  ``get_capacity`` is a round trip to the controller carrying the counts.

Systems: ``areal`` (AReaL 1.0.4's class), ``tqstream-embedded`` (the process's default cluster,
embedded: what ``install()`` gives a process with no ``TQSTREAM_ADDRESS``) and
``tqstream-procs-tcp`` (a controller in another process, over TCP loopback).

    python -m pytest benchmarks/test_areal_staleness.py --benchmark-json=FILE
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks._workload import quick

pytest.importorskip("areal")

from areal.infra.staleness_manager import StalenessManager as AReaLStalenessManager

import tqstream
from tqstream.adapters.areal import StalenessManager
from tqstream.client import budget as _budget

GROUP = "areal-staleness"
MANAGERS = ("tqstream-embedded", "tqstream-procs-tcp", "areal")
CASES = ("enqueued", "submitted", "accepted", "rejected", "rollout")
LIMITS = (1 << 30, 1 << 20, 1 << 20)  # never the bound: every round has capacity


class Version:
    def get_version(self) -> int:
        return 0


@pytest.fixture(scope="module", params=MANAGERS)
def manager(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """(system, manager)"""
    if request.param == "areal":
        yield request.param, AReaLStalenessManager(Version(), *LIMITS)
        return
    if request.param == "tqstream-embedded":
        m = StalenessManager(Version(), *LIMITS)
        yield request.param, m
        m.close()
        return
    with tqstream.ProcessCluster(1) as cluster, tqstream.connect(cluster.address) as client:
        m = StalenessManager(Version(), *LIMITS, client=client)
        yield request.param, m
        m.close()


def _quiet(manager: Any) -> None:
    """Wait until the reports of earlier callbacks went out and were answered."""
    if isinstance(manager, StalenessManager):
        while manager.budget._scheduled or _budget._reports:
            time.sleep(0)


@pytest.mark.parametrize("case", CASES)
def test_areal_staleness(benchmark: Any, manager: tuple[str, Any], case: str) -> None:
    system, m = manager
    before = {"enqueued": (), "submitted": ("enqueued",), "rollout": ("enqueued",)}.get(
        case, ("enqueued", "submitted")
    )

    def setup() -> None:
        for name in before:
            getattr(m, f"on_rollout_{name}")()
        _quiet(m)

    if case == "rollout":

        def target() -> None:
            assert m.get_capacity() > 0
            m.on_rollout_submitted()
            m.on_rollout_accepted()

    else:
        target = getattr(m, f"on_rollout_{case}")

    rounds = 20 if quick() else (500 if case == "rollout" else 3000)
    benchmark.group = GROUP
    benchmark.extra_info.update(
        system=system, case=case, bytes=0, batch=1, length=0, mode="", note=""
    )
    benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=0 if quick() else 50)
    stats = m.get_stats()  # every callback matched: nothing went below 0
    assert min(stats.enqueued, stats.running) >= 0
    if isinstance(m, StalenessManager):
        assert m.budget.state()["unmatched"] == 0
