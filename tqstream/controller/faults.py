"""Faults inside the controller state: a lost storage unit, a revived one, a peer that went away —
a mixin of :class:`~tqstream.controller.state.ControllerState`, split out to keep each file one
concept.

A *peer* is one client connection (the service learns from the transport when it drops: the
process died, its host went away, or it missed heartbeats). Whatever the peer held is given back at
once instead of at its deadlines: its parked gets, acquires and waiting puts are forgotten (nobody
is there to answer), its uncommitted puts rolled back, its leases released (the rows are available
again, as after a lease expiry), its admission slots released as rejected (capacity comes back)
and its StalenessManagers leave their budgets (their running rollouts come back).

A lost unit takes the rows it alone held with it: they are removed for every task and counted as
``lost`` per partition and per task (a task that had acked a row does not count it). Rows with a
replica on a live unit are served from there from now on; puts in flight that stored on the lost
unit are rolled back and their producers get ``UnitLostError``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from tqstream.controller.budget import Budgets
from tqstream.controller.partition import Partition, Row
from tqstream.controller.peers import peer_of
from tqstream.controller.records import (
    AdmissionTable,
    Effects,
    LeaseTable,
    ParkedGets,
    PendingPut,
    PutBook,
)
from tqstream.controller.units import UnitTable


class Faults:
    partitions: dict[str, Partition]
    units: UnitTable
    puts: PutBook
    leases: LeaseTable
    parked: ParkedGets
    admissions: AdmissionTable
    budgets: Budgets
    now: float
    ids: itertools.count[int]

    if TYPE_CHECKING:

        def _rollback(self, put: PendingPut, effects: Effects) -> None: ...
        def _evict(
            self, p: Partition, row_ids: list[int], effects: Effects, order: bool = True
        ) -> list[Row]: ...
        def settle(self, effects: Effects, now: float) -> Effects: ...

    # --- units ---
    def lose_unit(self, u: int, now: float) -> Effects:
        """Unit ``u`` is gone: give up what only it held (see the module docstring)."""
        effects = Effects()
        if not self.units.alive[u]:
            return effects
        for put in self.puts.where(unit=u):
            self.puts.end(put.put_id, "unit-lost")
            self._rollback(put, effects)
        for p in list(self.partitions.values()):
            gone = []
            for r in p.rows.values():
                if r.replica == u:
                    r.replica = -1
                elif r.unit == u:
                    if r.replica >= 0:
                        r.unit, r.replica = r.replica, -1  # served from the copy from now on
                    else:
                        gone.append(r.id)
            if not gone:
                continue
            for name in {*p.tasks, *p.registered}:
                t = p.task(name)
                t.lost += sum(1 for rid in gone if rid not in t.acked)
            removed = self._evict(p, gone, effects, order=False)
            p.lost += len(removed)
            self.units.lost_rows[u] += len(removed)
            if p.closed:  # parked gets may now learn that the partition is drained
                effects.touched.add(p.name)
        self.units.lose(u)
        effects.room = True  # puts waiting for room on it fail; the others replan
        return self.settle(effects, now)

    def revive_unit(self, u: int) -> Effects:
        """Unit ``u`` is reachable again (or registered again at its address): it takes new rows.
        The controller gave its rows up when it was lost, so the unit is told to drop every chunk
        older than now (``Effects.reset_units``); chunks of new puts are younger."""
        effects = Effects()
        if self.units.alive[u]:
            return effects
        self.units.revive(u)
        effects.reset_units.append((u, next(self.ids)))
        effects.room = True
        return self.settle(effects, self.now)

    # --- peers ---
    def drop_peer(self, peer: Any, now: float) -> Effects:
        """The connection ``peer`` dropped: give back everything it held (module docstring)."""
        effects = Effects()
        self.parked.drop_peer(peer)
        for handle, _ in self.admissions.waiting():
            if peer_of(handle) == peer:
                self.admissions.unpark(handle)
        for handle, _ in self.puts.waiting():
            if peer_of(handle) == peer:
                self.puts.unpark(handle)
        for put in self.puts.where(owner=peer):
            self.puts.end(put.put_id, "aborted")
            self._rollback(put, effects)
        touched = set()
        for lease in self.leases.where(owner=peer):
            p = self.partitions.get(lease.partition)
            if p is not None:
                p.release(lease.task, sorted(lease.rows))
                touched.add(p.name)
            self.leases.end(lease, "disconnected")
        for name, mine in self.admissions.take_peer(peer).items():
            if name in self.admissions:
                self.admissions[name].admission.release(mine, "rejected")
                effects.woken.add(name)
        self.budgets.drop_peer(peer)
        effects.touched |= touched
        return self.settle(effects, now)
