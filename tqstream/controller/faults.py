"""Faults inside the controller state: a lost storage unit, a revived one, a peer that went away.
Each table's owner gives up what the fault takes; this module only says who is told.

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

from tqstream.controller.catalog import Catalog
from tqstream.controller.flow import Flow
from tqstream.controller.gets import Gets
from tqstream.controller.leases import Leases
from tqstream.controller.puts import Puts
from tqstream.controller.records import Effects, Ids
from tqstream.controller.units import UnitTable


class Faults:
    def __init__(
        self,
        catalog: Catalog,
        writes: Puts,
        reads: Gets,
        leases: Leases,
        flow: Flow,
        units: UnitTable,
        ids: Ids,
    ) -> None:
        self.catalog = catalog
        self.writes = writes
        self.reads = reads
        self.leases = leases
        self.flow = flow
        self.units = units
        self.ids = ids

    def lose_unit(self, u: int) -> Effects:
        """Unit ``u`` is gone: give up what only it held (see the module docstring)."""
        effects = Effects()
        if not self.units.alive[u]:
            return effects
        self.writes.lose_unit(u, effects)
        self.catalog.lose_unit(u, effects)
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
        self.reads.drop_peer(peer)
        self.flow.drop_peer(peer, effects)
        self.writes.drop_peer(peer, effects)
        self.leases.drop_peer(peer, effects)
        return effects
