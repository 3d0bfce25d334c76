"""Faults inside the controller state: a lost storage unit, a revived one, a peer that went away.

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

from typing import Any

from tqstream.controller.book import PutBook
from tqstream.controller.budget import Budgets
from tqstream.controller.catalog import Catalog
from tqstream.controller.flow import AdmissionTable
from tqstream.controller.leases import LeaseTable
from tqstream.controller.parked import ParkedGets
from tqstream.controller.peers import peer_of
from tqstream.controller.puts import Puts
from tqstream.controller.records import Effects, Ids
from tqstream.controller.units import UnitTable
from tqstream.errors import UnitLostError


class Faults:
    def __init__(
        self,
        catalog: Catalog,
        writes: Puts,
        units: UnitTable,
        book: PutBook,
        leases: LeaseTable,
        parked: ParkedGets,
        admissions: AdmissionTable,
        budgets: Budgets,
        ids: Ids,
    ) -> None:
        self.catalog = catalog
        self.writes = writes  # puts in flight on a lost unit, or of a gone peer, roll back
        self.units = units
        self.book = book
        self.leases = leases
        self.parked = parked
        self.admissions = admissions
        self.budgets = budgets
        self.ids = ids

    def lose_unit(self, u: int) -> Effects:
        """Unit ``u`` is gone: give up what only it held (see the module docstring)."""
        effects = Effects()
        if not self.units.alive[u]:
            return effects
        for put in self.book.where(unit=u):
            self.book.end(put.put_id, "unit-lost")
            self.writes.rollback(put, effects)
        for token, half in self.book.halves_with(u):  # a copy of a replicated put: no pair now
            self.book.take_half(token)
            effects.failed.append((half.handle, UnitLostError(
                f"storage unit {u} ({self.units.addresses[u]}), one of the two units of a "
                f"replicated put, was lost before both held the rows; nothing was stored: put "
                f"again", unit=u, partition=half.req.partition,
            )))  # fmt: skip
        for p in list(self.catalog.partitions.values()):
            gone = p.rows.lose_unit(u)
            if not gone:
                continue
            for name in {*p.tasks, *p.registered}:
                t = p.task(name)
                t.lost += sum(1 for rid in gone if rid not in t.acked)
            removed = self.catalog.evict(p, gone, effects, order=False)
            p.lost += len(removed)
            self.units.lost_rows[u] += len(removed)
            if p.closed:  # parked gets may now learn that the partition is drained
                effects.touched.add(p.name)
        self.units.lose(u)
        effects.room = True  # puts waiting for room on it fail; the others replan
        return effects

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
        return effects

    def drop_peer(self, peer: Any) -> Effects:
        """The connection ``peer`` dropped: give back everything it held (module docstring)."""
        effects = Effects()
        self.parked.drop_peer(peer)
        for handle, _ in self.admissions.waiting():
            if peer_of(handle) == peer:
                self.admissions.unpark(handle)
        for handle, _ in self.book.waiting():
            if peer_of(handle) == peer:
                self.book.unpark(handle)
        for put in self.book.where(owner=peer):
            self.book.end(put.put_id, "aborted")
            self.writes.rollback(put, effects)
        for lease in self.leases.where(owner=peer):
            p = self.catalog.partitions.get(lease.partition)
            if p is not None:
                p.release(lease.task, sorted(lease.rows))
                effects.touched.add(p.name)
            self.leases.end(lease, "disconnected")
        for name, mine in self.admissions.take_peer(peer).items():
            if name in self.admissions:
                self.admissions[name].admission.release(mine, "rejected")
                effects.woken.add(name)
        self.budgets.drop_peer(peer)
        return effects
