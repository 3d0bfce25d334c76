"""Hypothesis: random puts, gets, acks, releases, lost and revived units and peers that go away,
on a controller state with three units and one or two copies of each row. After every step: no
row is on a lost unit, the units' byte counts are exactly what their rows hold, every lease holds
only live rows, and every row ever produced is accounted for (stored, freed or lost)."""

from __future__ import annotations

import contextlib
import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tqstream.controller.state import ControllerState
from tqstream.errors import TQStreamError
from tqstream.protocol.messages import GetMeta, PreparePut
from tqstream.types import FieldSchema

F32 = FieldSchema("dense", "float32", (2,))
UNITS = 3
PEERS = (b"a", b"b", b"c")


@dataclasses.dataclass(eq=False)
class Handle:
    peer: bytes


class FaultsMachine(RuleBasedStateMachine):
    @initialize(replicas=st.sampled_from([1, 2]))
    def start(self, replicas: int) -> None:
        self.s = ControllerState(lease_timeout=100.0, put_timeout=10.0)
        for u in range(UNITS):
            self.s.add_unit(f"tcp://u{u}")
        self.s.create_partition("p", ["a"], tasks=["t"], replicas=replicas)
        self.now = 0.0
        self.leases: dict[int, list[int]] = {}  # lease -> rows
        self.plans: list[int] = []  # prepared, uncommitted puts

    @rule(n=st.integers(1, 6), peer=st.sampled_from(PEERS), commit=st.booleans())
    def put(self, n: int, peer: bytes, commit: bool) -> None:
        req = PreparePut(rid=0, partition="p", n_rows=n, schemas={"a": F32}, nbytes=8 * n)
        try:
            plan = self.s.prepare_put(req, self.now, Handle(peer))
        except TQStreamError:
            return  # e.g. every unit lost: refused, nothing changed
        assert plan is not None
        if commit:
            self.s.commit(plan.put_id, self.now)
        else:
            self.plans.append(plan.put_id)

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def commit_later(self, data: st.DataObject) -> None:
        put_id = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
        # an error: rolled back meanwhile (its unit was lost, its peer went away), nothing kept
        with contextlib.suppress(TQStreamError):
            self.s.commit(put_id, self.now)

    @rule(n=st.integers(1, 8), peer=st.sampled_from(PEERS))
    def get(self, n: int, peer: bytes) -> None:
        req = GetMeta(rid=0, partition="p", fields=["a"], batch_size=n, task="t", timeout=0)
        try:
            meta, _ = self.s.get_meta(req, Handle(peer), self.now)
        except TQStreamError:
            return
        if meta is None:  # nothing to serve: it failed through the effects
            return
        assert meta.lease_id is not None
        lost = {u for u, ok in enumerate(self.s.units.alive) if not ok}
        assert not lost & set(meta.units), "a row served from a lost unit"
        self.leases[meta.lease_id] = list(meta.row_ids)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), ack=st.booleans())
    def finish(self, data: st.DataObject, ack: bool) -> None:
        lease = data.draw(st.sampled_from(sorted(self.leases)))
        rows = self.leases.pop(lease)
        try:
            if ack:
                self.s.ack("p", "t", lease, rows)
            else:
                self.s.release("p", "t", lease, rows, self.now)
        except TQStreamError:
            pass  # given back meanwhile (its peer went away)

    @rule(u=st.integers(0, UNITS - 1))
    def lose(self, u: int) -> None:
        self.s.lose_unit(u, self.now)

    @rule(u=st.integers(0, UNITS - 1))
    def revive(self, u: int) -> None:
        self.s.revive_unit(u)

    @rule(peer=st.sampled_from(PEERS))
    def peer_gone(self, peer: bytes) -> None:
        self.s.drop_peer(peer, self.now)

    @rule()
    def tick(self) -> None:
        self.now += 1.0
        self.s.expire(self.now)

    @invariant()
    def nothing_on_a_lost_unit_and_bytes_exact(self) -> None:
        s = self.s
        expected = [0] * UNITS
        for r in s.partitions["p"].rows.values():
            for u in (r.unit, r.replica):
                if u >= 0:
                    assert s.units.alive[u], f"row {r.id} kept on lost unit {u}"
                    expected[u] += r.nbytes
            assert r.replica != r.unit
        assert s.units.bytes == expected

    @invariant()
    def leases_hold_live_rows(self) -> None:
        rows = self.s.partitions["p"].rows
        for lease in self.s.leases.values():
            assert lease.rows <= set(rows)

    @invariant()
    def every_row_is_accounted_for(self) -> None:
        st_ = self.s.stats("p")["p"]
        assert st_.produced == st_.rows + st_.freed + st_.lost + st_.stale_dropped + st_.expired
        t = st_.tasks.get("t")
        if t is not None:
            assert t.available >= 0 and t.leased >= 0


FaultsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFaults = FaultsMachine.TestCase
